// `outcore train --config ds.json --model config.json --data tokens.bin [...]`: train a
// Llama-family model with a DeepSpeed config. "auto" values in the config are resolved from
// the model and the command line. Exit 0 when done, 2 for bad input, 1 for a failure while
// training, 130 after a clean stop on Ctrl-C.
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/error.hpp"
#include "common/json_dom.hpp"
#include "common/log.hpp"
#include "common/open_file.hpp"
#include "common/unique_fd.hpp"
#include "engine/ckpt/ckpt.hpp"
#include "engine/config/auto_fields.hpp"
#include "engine/config/config.hpp"
#include "engine/model/model.hpp"
#include "engine/train/trainer.hpp"
#include "tools/outcore/commands.hpp"
#include "tools/outcore/launch.hpp"
#include "tools/outcore/number_arg.hpp"
#include "tools/outcore/stop_signals.hpp"
#include "tools/outcore/test_hooks.hpp"
#include "tools/outcore/train_session.hpp"

namespace outcore::cli {
namespace {

namespace cfg = outcore::config;

// Numbers are taken as strings and converted here, so a bad value is reported like any
// other bad input (exit 2).
struct TrainCliOptions {
  std::string config, model, data, val_data, format = "auto", metrics, trace;
  std::string loss_mask, val_loss_mask;
  std::string save_dir, save_every, keep, resume, init_from;
  std::string comm = "auto";
  std::string device = "auto";
  std::string steps, seed, seq_len, lr, weight_decay, eval_every, eval_batches, val_fraction,
      train_batch_size, micro_batch_size, gradient_accumulation_steps, warmup_steps;
  bool activation_checkpointing = false;
  bool activation_checkpointing_given = false;  // the flag was on the command line (=true/false)
  bool start_over = false;
};

template <typename T>
bool parse_number(const std::string& text, const char* flag, std::optional<T>& out) {
  if (text.empty()) return true;
  T value{};
  if (const std::string allowed = parse_number_arg(text, value); !allowed.empty()) {
    std::fprintf(stderr, "error: %s: got \"%s\"; %s\n", flag, text.c_str(), allowed.c_str());
    return false;
  }
  out = value;
  return true;
}

struct Numbers {
  std::optional<int64_t> steps, seq_len, eval_every, eval_batches, train_batch_size,
      micro_batch_size, gradient_accumulation_steps, warmup_steps;
  std::optional<uint64_t> seed;
  std::optional<int64_t> save_every;
  std::optional<int> keep;
  std::optional<double> lr, weight_decay, val_fraction;
};

bool parse_numbers(const TrainCliOptions& o, Numbers& n) {
  return parse_number(o.steps, "--steps", n.steps) && parse_number(o.seed, "--seed", n.seed) &&
         parse_number(o.seq_len, "--seq-len", n.seq_len) && parse_number(o.lr, "--lr", n.lr) &&
         parse_number(o.weight_decay, "--weight-decay", n.weight_decay) &&
         parse_number(o.eval_every, "--eval-every", n.eval_every) &&
         parse_number(o.eval_batches, "--eval-batches", n.eval_batches) &&
         parse_number(o.val_fraction, "--val-fraction", n.val_fraction) &&
         parse_number(o.train_batch_size, "--train-batch-size", n.train_batch_size) &&
         parse_number(o.micro_batch_size, "--micro-batch-size", n.micro_batch_size) &&
         parse_number(o.gradient_accumulation_steps, "--gradient-accumulation-steps",
                      n.gradient_accumulation_steps) &&
         parse_number(o.warmup_steps, "--warmup-steps", n.warmup_steps) &&
         parse_number(o.save_every, "--save-every", n.save_every) &&
         parse_number(o.keep, "--keep", n.keep);
}

// Steps to run: --steps, else the scheduler's total_num_steps when the config sets it.
std::optional<int64_t> steps_from(const Numbers& n, const cfg::Config& c) {
  if (n.steps) return n.steps;
  const auto& s = c.scheduler;
  if (s.type == cfg::SchedulerType::kWarmupDecayLR && s.warmup.total_num_steps.has_value())
    return s.warmup.total_num_steps.value();
  if (s.type == cfg::SchedulerType::kWarmupCosineLR && s.cosine.total_num_steps.has_value())
    return s.cosine.total_num_steps.value();
  return std::nullopt;
}

// Why a config's value holds against a flag: its own (a number in the file, or the key's
// default), or, resumed without --config, the checkpoint's (`checkpoint`: its directory).
std::string held_by(const std::string& checkpoint) {
  if (checkpoint.empty()) return "the config's value or its default; \"auto\" there takes the flag";
  return fmt::format(
      "the value in {}/ds_config.json, which the resume keeps: give --config FILE to change it",
      checkpoint);
}

// A command-line value that "auto" would have taken but the config's value overrides: said,
// never dropped silently. `why`: held_by. `speak`: this process says it (rank 0 of a job).
template <typename T>
void warn_if_overridden(const cfg::AutoOr<T>& v, std::optional<T> cli, const char* flag,
                        const std::string& why, bool speak) {
  if (speak && cli && v.has_value() && v.value() != *cli)
    log::warn("{} {} not used: {} is {} ({})", flag, *cli, v.path(), v.value(), why);
}

// Why --lr leaves the run's learning rates as they are (empty: it sets them). `c` is the config
// before its "auto" values are filled, `why` held_by's. The schedule follows the optimizer's lr
// but for WarmupLR and WarmupDecayLR, which peak at warmup_max_lr (the optimizer's lr when left
// out), and OneCycle, which sets its own.
std::string lr_flag_unused(const cfg::Config& c, const std::string& why) {
  const cfg::SchedulerConfig& s = c.scheduler;
  auto held = [&](const cfg::AutoOr<double>& v) {
    return fmt::format("{} is {} ({})", v.path(), v.value(), why);
  };
  if (s.type == cfg::SchedulerType::kOneCycle)
    return "the OneCycle schedule sets the lr (scheduler.params.cycle_min_lr, cycle_max_lr)";
  if (s.type == cfg::SchedulerType::kWarmupLR || s.type == cfg::SchedulerType::kWarmupDecayLR) {
    if (s.warmup.warmup_max_lr.is_auto()) return "";
    if (s.warmup.warmup_max_lr.has_value()) return held(s.warmup.warmup_max_lr);
  }
  return c.optimizer.lr.has_value() ? held(c.optimizer.lr) : "";
}

// The keys of a run's own config that are "auto" or left out without a default, so that a flag
// or outcore's default fills them: saved with each checkpoint, so that a resume on the
// checkpoint's (resolved) config lets the same flags fill them again.
std::vector<std::string> auto_keys_of(const cfg::Config& c) {
  std::vector<std::string> keys;
  cfg::detail::for_each_auto(c, [&](const auto& field) {
    if (!field.has_value()) keys.emplace_back(field.path());
  });
  return keys;
}

// A resume on the checkpoint's config: the keys its run left to flags take this run's flags
// again where given (--steps lengthens a schedule whose total_num_steps was "auto").
void reopen_auto_keys(cfg::Config& c, const std::vector<std::string>& auto_keys, const Numbers& n) {
  auto reopen = [&](auto& field, bool given) {
    if (given && std::find(auto_keys.begin(), auto_keys.end(), field.path()) != auto_keys.end())
      field.set_auto();
  };
  reopen(c.optimizer.lr, n.lr.has_value());
  reopen(c.scheduler.warmup.warmup_max_lr, n.lr.has_value());  // WarmupLR peaks at --lr
  reopen(c.optimizer.weight_decay, n.weight_decay.has_value());
  reopen(c.scheduler.warmup.warmup_num_steps, n.warmup_steps.has_value());
  reopen(c.scheduler.cosine.warmup_num_steps, n.warmup_steps.has_value());
  reopen(c.scheduler.warmup.total_num_steps, n.steps.has_value());
  reopen(c.scheduler.cosine.total_num_steps, n.steps.has_value());
}

// A resumed run's config against its checkpoint's (`saved`, resolved when it was written): one
// line names every key that differs, with both values, so no change of the optimizer, the
// schedule or the placement goes unsaid. `from`: where this run's config came from.
void say_config_changes(const std::string& saved, const std::string& saved_source,
                        const cfg::Config& now, const std::string& from) {
  nlohmann::json before;
  try {  // a checkpoint's config this version no longer reads: nothing to compare
    before = nlohmann::json(cfg::to_json(cfg::parse_config(saved, saved_source, false).config))
                 .flatten();
  } catch (const Error&) {
    return;
  }
  const nlohmann::json after = nlohmann::json(cfg::to_json(now)).flatten();
  std::vector<std::string> changes;
  auto key = [](std::string k) {
    std::replace(k.begin(), k.end(), '/', '.');
    return k.substr(1);
  };
  for (const auto& [k, v] : after.items()) {
    const auto was = before.find(k);
    if (was == before.end())
      changes.push_back(fmt::format("{} {} (new)", key(k), v.dump()));
    else if (*was != v)
      changes.push_back(fmt::format("{} {} -> {}", key(k), was->dump(), v.dump()));
  }
  for (const auto& [k, v] : before.items())
    if (!after.contains(k)) changes.push_back(fmt::format("{} {} (gone)", key(k), v.dump()));
  if (changes.empty()) return;
  std::string list;
  for (const std::string& c : changes) list += (list.empty() ? "" : "; ") + c;
  log::warn("the resumed run's config ({}) differs from {}: {}", from, saved_source, list);
}

// A resumed run whose DeepSpeed config is the checkpoint's (`source`, its ds_config.json),
// which holds the batch sizes resolved at the world size it was saved at. Batch flags on the
// command line replace the checkpoint's values; of the keys they leave, the micro batch and
// then train_batch_size are kept until two are known, and resolve_auto infers the third.
// Without batch flags, where train_batch_size = micro x gas x `world` no longer holds,
// gradient_accumulation_steps is recomputed for `world` (the same global batch, so the run
// continues bit-identically) and, with `speak`, one line says so; when train_batch_size is
// not a multiple of micro x world, throws ConfigValidationError naming `source`, the three
// values, the world size and the ways out.
void fit_checkpoint_batch(cfg::Config& c, const Numbers& n, int64_t world,
                          const std::string& source, bool speak) {
  cfg::AutoOr<int64_t>& b = c.train_batch_size;
  cfg::AutoOr<int64_t>& m = c.train_micro_batch_size_per_gpu;
  cfg::AutoOr<int64_t>& g = c.gradient_accumulation_steps;
  if (!b.has_value() || !m.has_value() || !g.has_value()) return;  // resolve_auto's usual way
  std::optional<int64_t> nb = n.train_batch_size, nm = n.micro_batch_size,
                         ng = n.gradient_accumulation_steps;
  const int given = nb.has_value() + nm.has_value() + ng.has_value();
  if (given > 0) {
    if (given == 1 && nm)
      nb = b.value();
    else if (given == 1)
      nm = m.value();
    auto put = [](cfg::AutoOr<int64_t>& key, std::optional<int64_t> v) {
      v ? key.set(*v) : key.reset();
    };
    put(b, nb);
    put(m, nm);
    put(g, ng);
    return;
  }
  const int64_t tb = b.value(), mb = m.value(), gas = g.value();
  int64_t per_micro = 0, product = 0;
  if (__builtin_mul_overflow(mb, world, &per_micro)) return;  // resolve_auto reports it
  if (!__builtin_mul_overflow(gas, per_micro, &product) && product == tb) return;
  const std::string saved =
      fmt::format("train_batch_size {} = micro {} x gas {} x world {}", tb, mb, gas, tb / mb / gas);
  if (tb % per_micro != 0)
    throw cfg::ConfigValidationError(
        source, {{"train_batch_size",
                  fmt::format("saved as {}; at world size {} train_batch_size {} is not a "
                              "multiple of micro {} x world {}: resume with --config FILE (a "
                              "config for world size {}), or give --gradient-accumulation-steps "
                              "or --train-batch-size",
                              saved, world, tb, mb, world, world)}});
  g.set(tb / per_micro);
  if (speak)
    log::info(
        "{}: saved as {}; at world size {} gradient_accumulation_steps is {} (the same "
        "global batch)",
        source, saved, world, g.value());
}

// What a resumed run takes from its checkpoint when the command line does not say.
struct ResumeDefaults {
  std::string source;  // the checkpoint directory
  std::string ds_config, model_config;
  std::string train_data, val_data, train_mask, val_mask;
  double val_fraction = 0;
  int64_t seq_len = 0;
  int64_t save_every = 0;  // how the run saved (0: at the end only; all kept)
  int keep = 0;
  std::vector<std::string> auto_keys;     // config keys its run left to flags (auto_keys_of)
  bool activation_checkpointing = false;  // turned on by --activation-checkpointing
  std::string token_format;               // --format of its data ("": before it was saved)
  std::string metrics_file;               // where it wrote its metrics ("": nowhere)
  int64_t eval_every = 0;                 // how it validated (0: after the last step only)
  int64_t eval_batches = 0;               // 0: not saved (checkpoints before it): the default
  std::optional<uint64_t> seed;           // its run's (the data order goes on with it)
};

ResumeDefaults resume_defaults(const std::string& path) {
  const ckpt::Checkpoint ck = ckpt::Checkpoint::open(path);
  ResumeDefaults d;
  d.source = ck.dir().string();
  d.ds_config = ck.read_text("ds_config.json");
  d.model_config = ck.read_text("config.json");
  const nlohmann::json st =
      parse_json_file(ck.read_text("trainer_state.json"), d.source + "/trainer_state.json",
                      {.max_depth = kMaxJsonFileDepth, .on_repeated_key = {}},
                      [](const std::string& why) { throw CorruptData(why); });
  try {
    d.train_data = st.value("train_data", "");
    d.val_data = st.value("val_data", "");
    d.train_mask = st.value("train_mask", "");
    d.val_mask = st.value("val_mask", "");
    d.val_fraction = st.value("val_fraction", 0.0);
    d.seq_len = st.value("seq_len", int64_t{0});
    d.save_every = std::max<int64_t>(0, st.value("save_every", int64_t{0}));
    d.keep = std::max(0, st.value("keep", 0));
    d.auto_keys = st.value("config_auto_keys", std::vector<std::string>{});
    d.activation_checkpointing = st.value("activation_checkpointing", false);
    d.token_format = st.value("token_format", "");
    d.metrics_file = st.value("metrics_file", "");
    d.eval_every = std::max<int64_t>(0, st.value("eval_every", int64_t{0}));
    d.eval_batches = std::max<int64_t>(0, st.value("eval_batches", int64_t{0}));
    if (st.contains("seed")) d.seed = st.at("seed").get<uint64_t>();
  } catch (const nlohmann::json::exception& e) {  // a key of another type
    throw CorruptData(d.source + "/trainer_state.json: " + e.what());
  }
  return d;
}

// The loss mask of token file `data`: `flag_value` when given ("none": no mask), else
// `saved` when set (a resumed run's, "" for none: a run that trained without a mask goes on
// without one), else the .mask beside the file when there is one (what `outcore tokenize`
// writes for prompt/completion data). `flag`: the flag that gives it, for the warning that a
// mask beside the data goes unused.
std::string resolve_mask(const std::string& flag_value, const std::string* saved,
                         const std::string& data, const char* flag) {
  if (flag_value == "none" || data.empty()) return "";
  if (!flag_value.empty()) return flag_value;
  const std::string beside = train::mask_path_beside(data);
  std::error_code ec;
  const bool exists = std::filesystem::is_regular_file(beside, ec);
  if (saved == nullptr) return exists ? beside : "";
  if (saved->empty() && exists)
    log::warn(
        "the checkpoint trained {} without a loss mask, and so does this run: {} is not "
        "used (give {} {} to train with it from here on)",
        data, beside, flag, beside);
  return *saved;
}

// Every file under `dir` (recursively or not) as an input named by `flag`, so that no output
// flag can name one of them.
void add_input_files(std::vector<std::pair<std::string, const char*>>& inputs,
                     const std::string& dir, const char* flag, bool recursive) {
  namespace fs = std::filesystem;
  if (dir.empty()) return;
  std::error_code ec;
  if (recursive) {
    for (auto it = fs::recursive_directory_iterator(dir, ec); !ec && it != fs::end(it);
         it.increment(ec))
      inputs.emplace_back(it->path().string(), flag);
  } else {
    for (auto it = fs::directory_iterator(dir, ec); !ec && it != fs::end(it); it.increment(ec))
      inputs.emplace_back(it->path().string(), flag);
  }
}

// A sample of a regular file's contents, for comparing ranks (on several nodes one path may name
// different files: another tokenization, an older copy): CRC32C of its first and last MiB and of
// 64 KiB at 30 evenly spaced offsets, as 8 hex digits; "" when it cannot be read (the run's own
// checks name such a file).
std::string sampled_crc(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return "";
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
  struct stat st {};
  if (fd.get() < 0 || ::fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode)) return "";
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  constexpr uint64_t kEnd = 1 << 20, kBlock = 64 << 10, kBlocks = 30;
  std::vector<std::byte> buf(kEnd);
  uint32_t crc = 0;
  auto take = [&](uint64_t off, uint64_t len) {
    len = std::min(len, size - std::min(size, off));
    size_t got = 0;  // whole, across short reads and signals (until the file's end)
    while (got < len) {
      const ssize_t n =
          ::pread(fd.get(), buf.data() + got, len - got, static_cast<off_t>(off + got));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return false;
      if (n == 0) break;
      got += static_cast<size_t>(n);
    }
    crc = ckpt::crc32c(std::span(buf.data(), got), crc);
    return true;
  };
  bool ok = take(0, kEnd) && take(size - std::min(size, kEnd), kEnd);
  for (uint64_t i = 1; ok && i <= kBlocks; ++i) ok = take(size / (kBlocks + 1) * i, kBlock);
  return ok ? fmt::format("{:08x}", crc) : std::string();
}

// What every data-parallel rank must share (ranks_agree): the resolved config and the model
// config key by key, the data files with their sizes and a sample of their contents
// (sampled_crc), the files of --init-from and the manifest of the checkpoint resumed (which holds
// every file's CRC), paths as absolute paths.
std::vector<std::pair<std::string, std::string>> rank_settings(const cfg::Config& config,
                                                               const model::LlamaConfig& model,
                                                               const train::TrainerOptions& t,
                                                               const std::string& checkpoint) {
  namespace fs = std::filesystem;
  std::vector<std::pair<std::string, std::string>> out;
  auto add_json = [&](const std::string& prefix, const nlohmann::json& j) {
    const nlohmann::json flat = j.flatten();
    for (const auto& [key, value] : flat.items()) {
      std::string name = prefix + key;
      std::replace(name.begin() + static_cast<std::ptrdiff_t>(prefix.size()), name.end(), '/', '.');
      out.emplace_back(name.replace(prefix.size(), 1, ""), value.dump());
    }
  };
  auto path = [](const std::string& p) {
    if (p.empty()) return std::string();
    // Absolute: ranks in different working directories must not compare equal.
    const std::string abs = resolved_path(p);
    return abs.empty() ? p : abs;
  };
  auto file = [&](const std::string& p) {
    if (p.empty()) return std::string();
    std::error_code ec;
    const auto size = fs::file_size(p, ec);
    const std::string crc = sampled_crc(p);
    return fmt::format("{} ({} bytes{})", path(p), ec ? 0 : size,
                       crc.empty() ? "" : ", sampled CRC32C " + crc);
  };
  out.emplace_back("outcore version", outcore_version());
  add_json("config.", nlohmann::json(config::to_json(config)));
  add_json("model.", nlohmann::json::parse(model.to_json()));
  out.emplace_back("--data", file(t.train_data));
  out.emplace_back("--val-data", file(t.val_data));
  out.emplace_back("--loss-mask", file(t.train_mask));
  out.emplace_back("--val-loss-mask", file(t.val_mask));
  if (!t.init_from.empty()) {  // a Hugging Face directory: the files its loader reads, by name
    std::vector<std::string> names;
    std::error_code ec;
    for (auto it = fs::directory_iterator(t.init_from, ec); !ec && it != fs::end(it);
         it.increment(ec)) {
      const std::string n = it->path().filename().string();
      if (n == "config.json" || n.ends_with(".safetensors") ||
          n.ends_with(".safetensors.index.json"))
        names.push_back(n);
    }
    std::sort(names.begin(), names.end());
    out.emplace_back("--init-from", path(t.init_from));
    for (const std::string& n : names)
      out.emplace_back("--init-from " + n, file((fs::path(t.init_from) / n).string()));
  }
  if (!checkpoint.empty())
    out.emplace_back("--resume", file((fs::path(checkpoint) / ckpt::kManifestName).string()));
  out.emplace_back("--val-fraction", fmt::format("{}", t.val_fraction));
  out.emplace_back("--format", std::string(train::to_string(t.token_format)));
  out.emplace_back("--seq-len", std::to_string(t.seq_len));
  out.emplace_back("--steps", std::to_string(t.steps));
  out.emplace_back("--seed", std::to_string(t.seed));
  out.emplace_back("--device", std::to_string(static_cast<int>(t.device)));
  out.emplace_back("--activation-checkpointing", t.activation_checkpointing
                                                     ? (*t.activation_checkpointing ? "on" : "off")
                                                     : "config");
  out.emplace_back("--eval-every", std::to_string(t.eval_every));
  out.emplace_back("--eval-batches", std::to_string(t.eval_batches));
  out.emplace_back("--save-dir", path(t.save_dir));
  out.emplace_back("--save-every", std::to_string(t.save_every));
  out.emplace_back("--keep", std::to_string(t.keep));
  out.emplace_back("--start-over", t.start_over ? "yes" : "no");
  out.emplace_back("--resume", path(t.resume_from));
  out.emplace_back("--init-from", path(t.init_from));
  // Written by rank 0 alone: one given to another rank only would be dropped without a word.
  out.emplace_back("--metrics", path(t.metrics_file));
  out.emplace_back("--trace", path(t.trace_file));
  return out;
}

// Test hooks of checkpoint saves (a crash after N bytes or at a named point; off in the shipped
// binary), so the command-line tests can kill a save at any point.
ckpt::WriterOptions checkpoint_hooks() {
  ckpt::WriterOptions w;
  w.crash_after_bytes = test_hooks().ckpt_crash_after_bytes;
  w.crash_at = test_hooks().ckpt_crash_at;
  w.free_bytes = test_hooks().save_free_bytes;
  return w;
}

int run_train(const TrainCliOptions& o) {
  catch_early_stop();  // a Ctrl-C while the inputs are read stops the run as one during it
  start_delay_hook();
  std::optional<ResumeDefaults> rd;
  if (!o.resume.empty()) {
    if (!o.init_from.empty()) {
      std::fprintf(stderr, "error: --resume and --init-from exclude each other\n");
      return 2;
    }
    try {
      rd = resume_defaults(o.resume);
    } catch (const Error& e) {
      std::fprintf(stderr, "error: --resume %s: %s\n", o.resume.c_str(), e.what());
      return 2;
    }
  }
  std::string config_path = o.config;
  const char* config_flag = "--config";  // how messages name it
  if (config_path.empty()) {
    if (const char* env = std::getenv("OUTCORE_CONFIG")) {
      config_path = env;
      config_flag = "OUTCORE_CONFIG";
    }
  }
  if (config_path.empty() && !rd) {
    std::fprintf(stderr, "error: no DeepSpeed config: give --config or set OUTCORE_CONFIG\n");
    return 2;
  }
  std::string model_path = o.model;
  if (model_path.empty() && !o.init_from.empty()) {
    const std::filesystem::path dir(o.init_from);
    std::error_code ec;
    if (!std::filesystem::exists(dir / "config.json", ec) &&
        std::filesystem::exists(dir / ckpt::kLatestName, ec)) {
      std::fprintf(stderr,
                   "error: --init-from %s: a save directory of outcore checkpoints, not a Hugging "
                   "Face model directory: continue its run with --resume, or start a new one "
                   "from `outcore export` of it\n",
                   o.init_from.c_str());
      return 2;
    }
    model_path = (dir / "config.json").string();
  }
  std::string data = o.data, val_data = o.val_data;
  // --data naming the file the checkpoint trained on (by any path) is the checkpoint's data: its
  // validation split and masks carry over as when --data is not given.
  const bool data_from_resume = rd && (data.empty() || same_file(data, rd->train_data));
  if (data_from_resume) {
    if (data.empty()) data = rd->train_data;
    if (val_data.empty() && o.val_fraction.empty()) val_data = rd->val_data;
  } else if (rd && o.val_data.empty() && o.val_fraction.empty() &&
             (rd->val_fraction > 0 || !rd->val_data.empty())) {
    std::string split = "--val-data ";
    split += rd->val_data;
    if (rd->val_data.empty()) split = fmt::format("--val-fraction {}", rd->val_fraction);
    log::warn(
        "--data {} is not the data the checkpoint trained on ({}): its validation split ({}) "
        "does not carry over; give --val-fraction or --val-data",
        data, rd->train_data, split);
  }
  const std::string train_mask =
      resolve_mask(o.loss_mask, data_from_resume ? &rd->train_mask : nullptr, data, "--loss-mask");
  const bool saved_val = data_from_resume && !val_data.empty() &&
                         (val_data == rd->val_data || same_file(val_data, rd->val_data));
  const std::string val_mask = resolve_mask(o.val_loss_mask, saved_val ? &rd->val_mask : nullptr,
                                            val_data, "--val-loss-mask");
  if (model_path.empty() && !rd) {
    std::fprintf(stderr, "error: --model is required (or --init-from or --resume)\n");
    return 2;
  }
  if (data.empty()) {
    std::fprintf(stderr, "error: --data is required\n");
    return 2;
  }
  // Flags that would have no effect are refused rather than dropped.
  if (!o.val_loss_mask.empty() && o.val_loss_mask != "none" && val_data.empty()) {
    std::fprintf(stderr,
                 "error: --val-loss-mask %s: there is no --val-data for it to go with (the "
                 "validation tokens --val-fraction holds out take --data's mask)\n",
                 o.val_loss_mask.c_str());
    return 2;
  }
  if (!o.val_fraction.empty() && !o.val_data.empty()) {
    std::fprintf(stderr,
                 "error: --val-fraction %s holds out --data's tail for validation; with "
                 "--val-data %s there is nothing to hold out: give one of them\n",
                 o.val_fraction.c_str(), o.val_data.c_str());
    return 2;
  }
  Numbers n;
  if (!parse_numbers(o, n)) return 2;
  if (n.seq_len && *n.seq_len < 1) {
    std::fprintf(stderr, "error: --seq-len: got %lld; allowed: 1..max_position_embeddings\n",
                 static_cast<long long>(*n.seq_len));
    return 2;
  }
  struct Bound {
    std::optional<int64_t> value;
    const char* flag;
    int64_t min;
    int64_t max = std::numeric_limits<int64_t>::max();
  };
  // The flags that resolve a config's "auto" values too: an error names the flag, not the
  // config file they would go into.
  for (const Bound& b : {Bound{n.steps, "--steps", 1}, Bound{n.eval_every, "--eval-every", 0},
                         Bound{n.eval_batches, "--eval-batches", 1},
                         Bound{n.train_batch_size, "--train-batch-size", 1},
                         Bound{n.micro_batch_size, "--micro-batch-size", 1, cfg::kMaxMicroBatch},
                         Bound{n.gradient_accumulation_steps, "--gradient-accumulation-steps", 1},
                         Bound{n.warmup_steps, "--warmup-steps", 1}}) {
    if (b.value && *b.value < b.min) {
      std::fprintf(stderr, "error: %s: got %lld; allowed: an integer >= %lld\n", b.flag,
                   static_cast<long long>(*b.value), static_cast<long long>(b.min));
      return 2;
    }
    if (b.value && *b.value > b.max) {
      std::fprintf(stderr, "error: %s: got %lld; allowed: an integer in %lld..%lld\n", b.flag,
                   static_cast<long long>(*b.value), static_cast<long long>(b.min),
                   static_cast<long long>(b.max));
      return 2;
    }
  }
  for (const auto& [value, flag] :
       {std::pair{n.lr, "--lr"}, std::pair{n.weight_decay, "--weight-decay"}}) {
    if (value && *value < 0) {
      std::fprintf(stderr, "error: %s: got %g; allowed: a number >= 0\n", flag, *value);
      return 2;
    }
  }
  // A file the checkpoint named (not given now) says so, and how to go on without it.
  auto from_checkpoint = [&](const std::string& path, const std::string& given,
                             const std::string* saved, const char* flag, const char* instead) {
    return rd && given.empty() && saved != nullptr && path == *saved
               ? fmt::format("{} named by {}/trainer_state.json: give {}", flag, rd->source,
                             instead)
               : std::string();
  };
  const std::string* saved_train_data = rd ? &rd->train_data : nullptr;
  const std::string* saved_val_data = rd ? &rd->val_data : nullptr;
  const std::string* saved_train_mask = rd ? &rd->train_mask : nullptr;
  const std::string* saved_val_mask = rd ? &rd->val_mask : nullptr;
  if ((!config_path.empty() && !check_input_file(config_path, config_flag)) ||
      (!model_path.empty() && !check_input_file(model_path, "--model")) ||
      !check_input_file(data, "--data",
                        from_checkpoint(data, o.data, saved_train_data, "--data", "--data FILE")) ||
      (!val_data.empty() &&
       !check_input_file(
           val_data, "--val-data",
           from_checkpoint(val_data, o.val_data, saved_val_data, "--val-data",
                           "--val-data FILE, or --val-fraction 0 to go on without validation"))) ||
      (!train_mask.empty() &&
       !check_input_file(train_mask, "--loss-mask",
                         from_checkpoint(train_mask, o.loss_mask, saved_train_mask, "--loss-mask",
                                         "--loss-mask FILE, or --loss-mask none"))) ||
      (!val_mask.empty() &&
       !check_input_file(
           val_mask, "--val-loss-mask",
           from_checkpoint(val_mask, o.val_loss_mask, saved_val_mask, "--val-loss-mask",
                           "--val-loss-mask FILE, or --val-loss-mask none")))) {
    return 2;
  }

  const std::optional<DeviceChoice> device = choose_device(o.device);
  if (!device) return 2;
  // The ranks first: "auto" batch sizes resolve with the world size. The engine's collectives
  // run on host memory in this release (no NCCL), on a GPU as on the simulated device.
  std::optional<Ranks> ranks = open_ranks(o.comm, /*cuda_device=*/false);
  if (!ranks) return 2;
  // A rank that refuses its inputs before the ranks compare their settings (ranks_agree) ends
  // the job: the others would wait for it in that comparison forever.
  struct EndJobUnlessCompared {
    Ranks& ranks;
    bool compared = false;
    ~EndJobUnlessCompared() {
      if (!compared) fail_job(ranks.control.get(), 2);
    }
  } end_job{*ranks};
  train::TrainerOptions topts;
  topts.device = device->kind;
  topts.gpu = device->gpu;
  topts.comm = ranks->engine.get();
  topts.control_comm = ranks->control.get();
  cfg::Config config;
  model::LlamaConfig model;
  try {
    // The checkpoint's data is read as it was, unless told otherwise.
    topts.token_format = train::parse_token_format(
        o.format == "auto" && data_from_resume && !rd->token_format.empty() ? rd->token_format
                                                                            : o.format);
    model = model_path.empty()
                ? model::LlamaConfig::from_json(rd->model_config, rd->source + "/config.json")
                : model::LlamaConfig::load(model_path);
    const std::string config_source =
        config_path.empty() ? rd->source + "/ds_config.json" : config_path;
    // Its warnings said once its log_level is in force (log_level "error" hides them too).
    cfg::ParsedConfig parsed =
        config_path.empty()
            ? cfg::parse_saved_config(rd->ds_config, config_source, /*log_warnings=*/false)
            : cfg::load_config_file(config_path, /*log_warnings=*/false);
    config = std::move(parsed.config);
    log::init(config.outcore.log_level);
    for (const cfg::ConfigWarning& w : parsed.warnings) {
      // A value the checkpoint's run resolved from "auto" is outcore's, not one a user set.
      if (config_path.empty() &&
          std::find(rd->auto_keys.begin(), rd->auto_keys.end(), w.json_path) != rd->auto_keys.end())
        continue;
      log::warn("{}: {}", config_source, w.to_string());
    }
    if (config_path.empty()) {
      reopen_auto_keys(config, rd->auto_keys, n);
      topts.config_auto_keys = rd->auto_keys;
    } else {
      topts.config_auto_keys = auto_keys_of(config);
    }
    const std::string why = held_by(config_path.empty() ? rd->source : "");
    const bool speak = ranks->rank() == 0;
    std::optional<int64_t> steps = steps_from(n, config);
    if (!steps) {
      std::fprintf(stderr,
                   "error: give the number of training steps with --steps (or set the "
                   "scheduler's total_num_steps in %s)\n",
                   config_source.c_str());
      return 2;
    }
    cfg::AutoContext ctx;
    ctx.hidden_size = model.hidden_size;
    ctx.lr = n.lr;
    ctx.weight_decay = n.weight_decay;
    ctx.train_batch_size = n.train_batch_size;
    ctx.micro_batch_size = n.micro_batch_size;
    ctx.gradient_accumulation_steps = n.gradient_accumulation_steps;
    ctx.total_steps = *steps;
    ctx.warmup_steps = n.warmup_steps;
    ctx.world_size = ranks->world();
    // "auto" that Hugging Face's Trainer fills from its own flags, which outcore train has not:
    // resolved to DeepSpeed's defaults, said once.
    if (ranks->rank() == 0) {
      if (config.fp16.enabled.is_auto())
        log::warn("fp16.enabled is \"auto\": resolved to false (set true or false in the config)");
      if (config.bf16.enabled.is_auto())
        log::warn("bf16.enabled is \"auto\": resolved to false (set true or false in the config)");
      if (config.gradient_clipping.is_auto())
        log::info("gradient_clipping is \"auto\": resolved to 1.0 (set a number in the config)");
    }
    if (n.lr && speak) {
      if (const std::string unused = lr_flag_unused(config, why); !unused.empty())
        log::warn("--lr {} not used: {}", *n.lr, unused);
    }
    warn_if_overridden(config.optimizer.weight_decay, n.weight_decay, "--weight-decay", why, speak);
    if (config_path.empty())
      fit_checkpoint_batch(config, n, ranks->world(), config_source, ranks->rank() == 0);
    // The batch flags that fill a key the config leaves out (or sets to "auto"): an error of
    // the batch arithmetic names them, since the config alone does not hold those values.
    std::string filled_by_flags;
    auto note_fill = [&](const cfg::AutoOr<int64_t>& v, std::optional<int64_t> cli,
                         const char* flag) {
      if (cli && !v.has_value())
        filled_by_flags += fmt::format("; {} {} came from {}", v.path(), *cli, flag);
    };
    note_fill(config.train_batch_size, n.train_batch_size, "--train-batch-size");
    note_fill(config.train_micro_batch_size_per_gpu, n.micro_batch_size, "--micro-batch-size");
    note_fill(config.gradient_accumulation_steps, n.gradient_accumulation_steps,
              "--gradient-accumulation-steps");
    try {
      cfg::resolve_auto(config, ctx);
      cfg::require_resolved(config);
    } catch (const cfg::ConfigValidationError& e) {  // batch arithmetic: name the file
      if (!e.source().empty()) throw;
      std::vector<cfg::ConfigIssue> issues = e.issues();
      for (cfg::ConfigIssue& i : issues)
        if (i.json_path == "train_batch_size" || i.json_path == "train_micro_batch_size_per_gpu" ||
            i.json_path == "gradient_accumulation_steps")
          i.message += filled_by_flags;
      throw cfg::ConfigValidationError(config_source, std::move(issues));
    }
    warn_if_overridden(config.train_batch_size, n.train_batch_size, "--train-batch-size", why,
                       speak);
    warn_if_overridden(config.train_micro_batch_size_per_gpu, n.micro_batch_size,
                       "--micro-batch-size", why, speak);
    warn_if_overridden(config.gradient_accumulation_steps, n.gradient_accumulation_steps,
                       "--gradient-accumulation-steps", why, speak);
    if (config.scheduler.type == cfg::SchedulerType::kWarmupCosineLR)
      warn_if_overridden(config.scheduler.cosine.warmup_num_steps, n.warmup_steps, "--warmup-steps",
                         why, speak);
    else if (config.scheduler.type == cfg::SchedulerType::kWarmupLR ||
             config.scheduler.type == cfg::SchedulerType::kWarmupDecayLR)
      warn_if_overridden(config.scheduler.warmup.warmup_num_steps, n.warmup_steps, "--warmup-steps",
                         why, speak);
    else if (n.warmup_steps && speak)
      log::warn("--warmup-steps {} not used: the config's scheduler has no warmup",
                *n.warmup_steps);
    topts.steps = *steps;
    if (rd && ranks->rank() == 0)
      say_config_changes(
          rd->ds_config, rd->source + "/ds_config.json", config,
          config_path.empty() ? "the checkpoint's, with this run's flags" : config_path);
  } catch (const Error& e) {  // ConfigError, IoError reading a checked file, bad --format
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }

  std::string metrics = o.metrics.empty() ? config.outcore.metrics_file : o.metrics;
  // On its checkpoint's config, a relative metrics_file named the file where that run started:
  // the run's own file (saved absolute), not one of that name where this one starts.
  const bool checkpoints_file = o.metrics.empty() && config_path.empty() && rd &&
                                !rd->metrics_file.empty() && !metrics.empty() &&
                                std::filesystem::path(metrics).is_relative();
  if (checkpoints_file) metrics = rd->metrics_file;
  // Not carried over: a resume from an earlier checkpoint would cut the later records of the
  // run's own log. Said, with the way to go on writing it.
  if (metrics.empty() && rd && !rd->metrics_file.empty() && ranks->rank() == 0)
    log::info(
        "metrics: none written by this run (its checkpoint's run wrote {}: give --metrics {} "
        "to go on writing it)",
        rd->metrics_file, rd->metrics_file);
  std::vector<std::pair<std::string, const char*>> inputs = {
      {config_path, config_flag}, {model_path, "--model"},     {data, "--data"},
      {val_data, "--val-data"},   {train_mask, "--loss-mask"}, {val_mask, "--val-loss-mask"}};
  add_input_files(inputs, o.init_from, "--init-from", false);
  if (rd) {
    add_input_files(inputs, rd->source, "--resume", true);
    inputs.emplace_back((std::filesystem::path(o.resume) / ckpt::kLatestName).string(), "--resume");
  }
  if (!check_output_file(metrics, o.metrics.empty() ? "outcore.metrics_file" : "--metrics", inputs))
    return 2;
  inputs.emplace_back(metrics, o.metrics.empty() ? "outcore.metrics_file" : "--metrics");
  if (!check_output_file(o.trace, "--trace", inputs, "an input or another output")) return 2;
  if (!check_outside_checkpoints(metrics, o.metrics.empty() ? "outcore.metrics_file" : "--metrics",
                                 o.save_dir) ||
      !check_not_a_save_name(metrics, o.metrics.empty() ? "outcore.metrics_file" : "--metrics") ||
      !check_swap_paths_outside_saves(config, o.save_dir) ||
      !check_outputs_outside_swap(
          config, {{metrics, o.metrics.empty() ? "outcore.metrics_file" : "--metrics"},
                   {o.trace, "--trace"}}) ||
      !check_outside_checkpoints(o.trace, "--trace", o.save_dir) ||
      !check_not_a_save_name(o.trace, "--trace") ||
      !check_replaces_only_a_trace(o.trace, "--trace"))
    return 2;
  topts.trace_file = o.trace;
  topts.train_data = data;
  topts.val_data = val_data;
  topts.train_mask = train_mask;
  topts.val_mask = val_mask;
  topts.val_fraction =
      n.val_fraction.value_or(data_from_resume && o.val_data.empty() ? rd->val_fraction : 0.0);
  if (!o.save_dir.empty()) {
    if (const std::optional<std::filesystem::path> in = ckpt::checkpoint_holding(o.save_dir)) {
      std::fprintf(stderr,
                   "error: --save-dir %s: inside checkpoint %s; save next to it (its save "
                   "directory) or elsewhere\n",
                   o.save_dir.c_str(), in->string().c_str());
      return 2;
    }
    if (!check_not_a_save_name(o.save_dir, "--save-dir")) return 2;
  }
  topts.save_dir = o.save_dir;
  // Resumed into the save directory it came from, the run saves as it did unless told otherwise.
  const bool same_save_dir =
      rd && !o.save_dir.empty() &&
      same_file(o.save_dir, std::filesystem::path(rd->source).parent_path().string());
  topts.save_every = n.save_every.value_or(same_save_dir ? rd->save_every : 0);
  topts.keep = n.keep.value_or(same_save_dir ? rd->keep : 0);
  topts.start_over = o.start_over;
  topts.resume_from = o.resume;
  topts.init_from = o.init_from;
  topts.checkpoint_io = checkpoint_hooks();
  if ((topts.save_every != 0 || topts.keep != 0 || topts.start_over) && topts.save_dir.empty()) {
    std::fprintf(stderr, "error: --save-every, --keep and --start-over need --save-dir\n");
    return 2;
  }
  if (topts.save_every < 0 || topts.keep < 0) {
    std::fprintf(stderr, "error: --save-every and --keep must be >= 0\n");
    return 2;
  }
  // A resume goes on with its checkpoint's seed; one given that differs is warned about.
  if (n.seed)
    topts.seed = *n.seed;
  else if (rd && rd->seed)
    topts.seed = *rd->seed;
  topts.seq_len = n.seq_len.value_or(rd ? rd->seq_len : 0);
  // A resume validates as its run did, where it has a validation set.
  const bool validates = !topts.val_data.empty() || topts.val_fraction > 0;
  topts.eval_every = n.eval_every.value_or(rd && validates ? rd->eval_every : 0);
  if (n.eval_batches && !validates) {  // refused rather than dropped, as --eval-every is
    std::fprintf(stderr,
                 "error: --eval-batches %lld: there is no validation set for it (--val-data or "
                 "--val-fraction)\n",
                 static_cast<long long>(*n.eval_batches));
    return 2;
  }
  if (n.eval_batches)
    topts.eval_batches = *n.eval_batches;
  else if (rd && rd->eval_batches > 0)
    topts.eval_batches = rd->eval_batches;
  // The flag carries over, with the checkpoint's config or another: a resume computes as its
  // run did (and fits the same budget) unless --activation-checkpointing=false says otherwise.
  if (o.activation_checkpointing_given)
    topts.activation_checkpointing = o.activation_checkpointing;
  else if (rd && rd->activation_checkpointing)
    topts.activation_checkpointing = true;
  topts.metrics_file = checkpoints_file ? metrics : o.metrics;
  end_job.compared = true;  // every rank reaches the comparison (or returned 2 above: ended)
  if (ranks->world() > 1 &&
      !ranks_agree(*ranks->control, rank_settings(config, model, topts, rd ? rd->source : "")))
    return 2;
  const std::string config_file = !config_path.empty() ? config_path
                                  : rd                 ? rd->source + "/ds_config.json"
                                                       : "";
  return run_training(config, model, std::move(topts), config_file);
}

}  // namespace

void add_train_command(CLI::App& app, int& rc) {
  auto o = std::make_shared<TrainCliOptions>();
  CLI::App* cmd = app.add_subcommand(
      "train",
      "Train a Llama, Mistral, Qwen2 or Qwen3 model (Hugging Face config.json) on token files "
      "with a DeepSpeed JSON config. Progress on stderr, the resolved setup and the result on "
      "stdout. Exit 0 when done, 2 for bad input, 1 for a failure while training, 130 after "
      "Ctrl-C (the step in progress finishes and swap files are removed).");
  cmd->add_option("--config", o->config, "DeepSpeed JSON config (default: $OUTCORE_CONFIG)");
  cmd->add_option("--model", o->model,
                  "Hugging Face config.json, model_type llama, mistral, qwen2 or qwen3 (required "
                  "unless --init-from or --resume gives the model)");
  cmd->add_option("--data", o->data, "training tokens: llm.c .bin, raw .u16 or .u32 (required)");
  cmd->add_option("--val-data", o->val_data, "validation tokens (same formats)");
  cmd->add_option("--loss-mask", o->loss_mask,
                  "loss mask of --data (one byte per token, 1 = trained on; `outcore tokenize` "
                  "writes it for prompt/completion data); default: the .mask beside --data when "
                  "there is one (resuming on the checkpoint's data: the checkpoint's mask, or "
                  "none if it trained without); none: no mask");
  cmd->add_option("--val-loss-mask", o->val_loss_mask,
                  "loss mask of --val-data (default: as --loss-mask's, beside --val-data; none: "
                  "no mask)");
  cmd->add_option("--val-fraction", o->val_fraction,
                  "without --val-data: hold out this fraction of --data's tail for validation");
  cmd->add_option("--format", o->format,
                  "token file format: auto (by extension), llmc, u16 or u32 (a resume on its "
                  "checkpoint's data: the format its run was given)");
  cmd->add_option("--steps", o->steps,
                  "optimizer steps (default: the scheduler's total_num_steps); resolves "
                  "\"auto\" total_num_steps");
  cmd->add_option("--seed", o->seed, "seed of the initial weights and the data order (1234)");
  cmd->add_option("--seq-len", o->seq_len,
                  "tokens per sequence (default: max_position_embeddings, at most 1024)");
  cmd->add_option("--lr", o->lr, "learning rate; resolves \"auto\" lr values");
  cmd->add_option("--weight-decay", o->weight_decay, "resolves \"auto\" weight_decay");
  cmd->add_option("--train-batch-size", o->train_batch_size, "resolves \"auto\" train_batch_size");
  cmd->add_option("--micro-batch-size", o->micro_batch_size,
                  "resolves \"auto\" train_micro_batch_size_per_gpu");
  cmd->add_option("--gradient-accumulation-steps", o->gradient_accumulation_steps,
                  "resolves \"auto\" gradient_accumulation_steps");
  cmd->add_option("--warmup-steps", o->warmup_steps, "resolves \"auto\" warmup_num_steps");
  cmd->add_option("--eval-every", o->eval_every,
                  "validation loss every K steps (default: after the last step only; a resume: "
                  "its run's)");
  cmd->add_option("--eval-batches", o->eval_batches,
                  "micro-batches per validation (default 8; a resume: its run's)");
  CLI::Option* checkpointing = cmd->add_flag(
      "--activation-checkpointing", o->activation_checkpointing,
      "recompute each layer's forward in backward (also on when the config's "
      "activation_checkpointing section sets cpu_checkpointing, partition_activations or "
      "number_checkpoints); a resume keeps its run's flag; =false turns it off");
  cmd->add_option("--save-dir", o->save_dir,
                  "save checkpoints here: at the end, after Ctrl-C / SIGTERM, and every "
                  "--save-every steps (DIR/global_step<N>, DIR/latest)");
  cmd->add_option("--save-every", o->save_every, "checkpoint every N optimizer steps");
  cmd->add_option("--keep", o->keep, "keep only the newest K checkpoints (default, and 0: all)");
  cmd->add_flag("--start-over", o->start_over,
                "save into a --save-dir that holds another run's checkpoints: they are removed "
                "once this run's first checkpoint is saved (without it, such a directory is "
                "refused unless --resume names a checkpoint in it)");
  cmd->add_option("--resume", o->resume,
                  "continue from a checkpoint, or a save directory's latest one; the config, "
                  "model and data default to the checkpoint's");
  cmd->add_option("--init-from", o->init_from,
                  "start from a Hugging Face model directory (config.json + safetensors); "
                  "--model defaults to its config.json");
  cmd->add_option("--comm", o->comm,
                  "data-parallel transport: auto (MPI when started by mpirun, else one rank), "
                  "local, mpi; nccl is refused: training does not use NCCL in this release");
  cmd->add_option("--device", o->device,
                  "where the model computes: auto (a GPU when the build has CUDA and the machine "
                  "has one, else the simulated device), cpu (the simulated device), cuda");
  cmd->add_option("--metrics", o->metrics,
                  "JSON-lines metrics file (default: the config's outcore.metrics_file)");
  cmd->add_option("--trace", o->trace,
                  "Chrome trace-event JSON of the run (open in Perfetto or chrome://tracing)");
  cmd->callback([o, checkpointing, &rc] {
    o->activation_checkpointing_given = checkpointing->count() > 0;
    rc = run_train(*o);
  });
}

}  // namespace outcore::cli
