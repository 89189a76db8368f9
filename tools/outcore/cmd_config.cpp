// `outcore config [FILE]`: validate a DeepSpeed JSON config, resolve its "auto" values from
// the command line and print the result as JSON on stdout (exit 0), or print every error on
// stderr (exit 2). FILE defaults to $OUTCORE_CONFIG.
#include <fmt/format.h>

#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>

#include "common/error.hpp"
#include "common/log.hpp"
#include "engine/config/config.hpp"
#include "tools/outcore/commands.hpp"
#include "tools/outcore/number_arg.hpp"

namespace outcore::cli {
namespace {

namespace cfg = outcore::config;

// Numbers are taken as strings and converted here, so a bad value is reported like any
// other bad input (exit 2) rather than by CLI11's own exit codes.
struct ConfigOptions {
  std::string file;
  std::string world_size, hidden_size, lr, weight_decay, train_batch_size, micro_batch_size,
      gradient_accumulation_steps, total_steps, warmup_steps;
};

void print_issues(const std::string& source, const std::vector<cfg::ConfigIssue>& issues) {
  for (const cfg::ConfigIssue& i : issues) {
    std::fprintf(stderr, "error: %s%s\n", source.empty() ? "" : (source + ": ").c_str(),
                 i.to_string().c_str());
  }
}

// Parses `text` (an option's value) into `out`; records an error naming `flag` otherwise.
template <typename T>
void parse_number(const std::string& text, const char* flag, std::optional<T>& out,
                  std::vector<cfg::ConfigIssue>& errors) {
  if (text.empty()) return;
  T value{};
  if (const std::string allowed = parse_number_arg(text, value); !allowed.empty()) {
    errors.push_back({"", std::string(flag) + ": got \"" + text + "\"; " + allowed});
    return;
  }
  out = value;
}

// Records an error naming `flag` when `v` is set and below `min`.
template <typename T>
void check_min(const std::optional<T>& v, const std::string& text, const char* flag, T min,
               std::vector<cfg::ConfigIssue>& errors) {
  if (v && *v < min)
    errors.push_back({"", std::string(flag) + ": got \"" + text +
                              "\"; allowed: a number >= " + fmt::format("{}", min)});
}

// Records an error naming `flag` when `v` is set and outside 1..max.
void check_range(const std::optional<int64_t>& v, const std::string& text, const char* flag,
                 int64_t max, std::vector<cfg::ConfigIssue>& errors) {
  if (v && (*v < 1 || *v > max))
    errors.push_back({"", std::string(flag) + ": got \"" + text + "\"; allowed: an integer in 1.." +
                              std::to_string(max)});
}

cfg::AutoContext context_from(const ConfigOptions& o, std::vector<cfg::ConfigIssue>& errors) {
  cfg::AutoContext ctx;
  std::optional<int64_t> world;
  parse_number(o.world_size, "--world-size", world, errors);
  check_range(world, o.world_size, "--world-size", cfg::kMaxWorldSize, errors);
  if (world) ctx.world_size = *world;
  parse_number(o.hidden_size, "--hidden-size", ctx.hidden_size, errors);
  parse_number(o.lr, "--lr", ctx.lr, errors);
  parse_number(o.weight_decay, "--weight-decay", ctx.weight_decay, errors);
  parse_number(o.train_batch_size, "--train-batch-size", ctx.train_batch_size, errors);
  parse_number(o.micro_batch_size, "--micro-batch-size", ctx.micro_batch_size, errors);
  check_range(ctx.micro_batch_size, o.micro_batch_size, "--micro-batch-size", cfg::kMaxMicroBatch,
              errors);
  parse_number(o.gradient_accumulation_steps, "--gradient-accumulation-steps",
               ctx.gradient_accumulation_steps, errors);
  parse_number(o.total_steps, "--total-steps", ctx.total_steps, errors);
  parse_number(o.warmup_steps, "--warmup-steps", ctx.warmup_steps, errors);
  check_min(ctx.hidden_size, o.hidden_size, "--hidden-size", int64_t{1}, errors);
  check_min(ctx.lr, o.lr, "--lr", 0.0, errors);
  check_min(ctx.weight_decay, o.weight_decay, "--weight-decay", 0.0, errors);
  check_min(ctx.train_batch_size, o.train_batch_size, "--train-batch-size", int64_t{1}, errors);
  check_min(ctx.gradient_accumulation_steps, o.gradient_accumulation_steps,
            "--gradient-accumulation-steps", int64_t{1}, errors);
  check_min(ctx.total_steps, o.total_steps, "--total-steps", int64_t{1}, errors);
  check_min(ctx.warmup_steps, o.warmup_steps, "--warmup-steps", int64_t{1}, errors);
  return ctx;
}

int run_config(const ConfigOptions& o) {
  std::string file = o.file;
  if (file.empty()) {
    const char* env = std::getenv("OUTCORE_CONFIG");
    if (env) file = env;
  }
  if (file.empty()) {
    std::fprintf(stderr, "error: no config file: give FILE or set OUTCORE_CONFIG\n");
    return 2;
  }
  std::vector<cfg::ConfigIssue> errors;
  cfg::AutoContext ctx = context_from(o, errors);
  if (!errors.empty()) {
    print_issues("", errors);
    return 2;
  }
  try {
    cfg::ParsedConfig parsed = cfg::load_config_file(file);
    cfg::resolve_auto(parsed.config, ctx);
    std::string out = cfg::to_json(parsed.config).dump(2);
    std::fprintf(stdout, "%s\n", out.c_str());
    for (const std::string& path : cfg::unresolved_auto(parsed.config)) {
      log::info(
          "{}: {} is still \"auto\"; the trainer resolves it from the model and the "
          "command line",
          file, path);
    }
    return 0;
  } catch (const cfg::ConfigValidationError& e) {
    print_issues(e.source().empty() ? file : e.source(), e.issues());
    return 2;
  }
}

}  // namespace

void add_config_command(CLI::App& app, int& rc) {
  auto opts = std::make_shared<ConfigOptions>();
  CLI::App* cmd = app.add_subcommand(
      "config",
      "Check a DeepSpeed JSON config and print it resolved, with every default, as JSON. "
      "Exit 0 when valid, 2 with every error on stderr otherwise.");
  cmd->add_option("file", opts->file, "config file (default: $OUTCORE_CONFIG)");
  cmd->add_option("--world-size", opts->world_size, "data-parallel ranks (default 1)");
  cmd->add_option("--hidden-size", opts->hidden_size,
                  "model hidden size, resolves \"auto\" ZeRO bucket sizes");
  cmd->add_option("--lr", opts->lr, "learning rate, resolves \"auto\" lr values");
  cmd->add_option("--weight-decay", opts->weight_decay, "resolves \"auto\" weight_decay");
  cmd->add_option("--train-batch-size", opts->train_batch_size,
                  "resolves \"auto\" train_batch_size");
  cmd->add_option("--micro-batch-size", opts->micro_batch_size,
                  "resolves \"auto\" train_micro_batch_size_per_gpu");
  cmd->add_option("--gradient-accumulation-steps", opts->gradient_accumulation_steps,
                  "resolves \"auto\" gradient_accumulation_steps");
  cmd->add_option("--total-steps", opts->total_steps,
                  "training steps, resolves \"auto\" total_num_steps");
  cmd->add_option("--warmup-steps", opts->warmup_steps, "resolves \"auto\" warmup_num_steps");
  cmd->callback([opts, &rc] { rc = run_config(*opts); });
}

}  // namespace outcore::cli
