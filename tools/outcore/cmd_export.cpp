// `outcore export PATH DIR [--dtype auto|fp32|bf16|fp16]
// (or --checkpoint PATH --out DIR)
// [--max-shard-size 5GB] [--no-verify]`: writes the fp32 master weights of an outcore checkpoint as
// a Hugging Face model directory under the model's own model_type (config.json + safetensors,
// sharded with an index above the shard size). PATH is a checkpoint directory or a save directory
// whose `latest` names one. Exit 0 when written, 2 on bad input (unreadable or corrupt checkpoint,
// non-empty DIR, bad option), 1 when writing fails, 130 when SIGINT, SIGTERM or SIGHUP stopped it
// (the partial output removed; a second signal kills at once). The files are written in
// DIR.tmp-<pid> and renamed to DIR at the end; such a directory left by an export that was killed
// (SIGKILL) is removed by the next export into DIR.
#include <fmt/format.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "common/error.hpp"
#include "common/open_file.hpp"
#include "engine/ckpt/ckpt.hpp"
#include "engine/ckpt/hf.hpp"
#include "engine/model/model.hpp"
#include "swap/swap.hpp"
#include "tools/outcore/commands.hpp"
#include "tools/outcore/stop_signals.hpp"
#include "tools/outcore/test_hooks.hpp"
#include "tools/outcore/train_session.hpp"

namespace outcore::cli {
namespace {

namespace fs = std::filesystem;

struct ExportArgs {
  std::string checkpoint, out, dtype = "auto", max_shard_size = "5GB";
  bool no_verify = false;
};

void throw_if_stopped() {
  if (stop_flag().load(std::memory_order_relaxed))
    throw Interrupted("export interrupted by a signal");
}

// The directory write_hf_model exports to: absolute, normalized, without a trailing slash.
fs::path export_target(const std::string& out) {
  fs::path p = fs::absolute(out).lexically_normal();
  return p.has_filename() ? p : p.parent_path();
}

// Removes the `<out>.tmp-<pid>` directories left next to `out` by exports that were killed
// (SIGKILL): only those whose pid runs no more and that are an export's
// (ckpt::is_export_scratch).
// Any other is left, with a warning on stderr.
void remove_killed_exports(const fs::path& out) {
  const std::string prefix = out.filename().string() + ".tmp-";
  std::error_code ec;
  for (fs::directory_iterator it(out.parent_path(), ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (!name.starts_with(prefix) || name.size() == prefix.size()) continue;
    const std::string digits = name.substr(prefix.size());
    pid_t pid = 0;
    const auto [ptr, perr] = std::from_chars(digits.data(), digits.data() + digits.size(), pid);
    if (perr != std::errc() || ptr != digits.data() + digits.size() || pid <= 0 ||
        digits.front() == '0' || pid == ::getpid())
      continue;
    std::error_code sec;
    if (!fs::is_directory(it->symlink_status(sec)) || sec) continue;
    if (::kill(pid, 0) == 0 || errno != ESRCH) continue;  // that export may still be running
    if (!ckpt::is_export_scratch(it->path())) {
      std::fprintf(stderr,
                   "warning: %s: named like the temporary directory of an export (pid %d, no "
                   "longer running), but without its marker %s (an export killed as it renamed "
                   "its finished files: use or remove it) or holding files an export does not "
                   "write; not removed\n",
                   it->path().c_str(), static_cast<int>(pid), ckpt::kExportScratchMarker);
      continue;
    }
    fs::remove_all(it->path(), sec);
    if (sec)
      std::fprintf(stderr, "warning: %s: left by an export that was killed; cannot remove: %s\n",
                   it->path().c_str(), sec.message().c_str());
  }
}

// "5GB" (10^9), "2GiB" (2^30), "500MB", "1TB", "4096" (bytes): a whole number, as Hugging
// Face's max_shard_size. InvalidArgument naming the flag and every unit.
uint64_t parse_size(const std::string& text) {
  uint64_t v = 0;
  const char* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(text.data(), end, v);
  std::string unit(ptr, end);
  for (char& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  static const std::pair<const char*, uint64_t> kUnits[] = {{"", 1},
                                                            {"B", 1},
                                                            {"KB", 1000},
                                                            {"MB", 1000000},
                                                            {"GB", 1000000000},
                                                            {"TB", 1000000000000},
                                                            {"KIB", 1 << 10},
                                                            {"MIB", 1 << 20},
                                                            {"GIB", uint64_t{1} << 30},
                                                            {"TIB", uint64_t{1} << 40}};
  for (const auto& [name, scale] : kUnits) {
    if (ec == std::errc() && ptr != text.data() && unit == name && v > 0 && v <= UINT64_MAX / scale)
      return v * scale;
  }
  throw InvalidArgument("--max-shard-size: got \"" + text +
                        "\"; allowed: a whole number above 0 of bytes, or of B, KB, MB, GB, TB "
                        "(powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), such as 5GB");
}

// The dtype --dtype names; nullopt for "auto". InvalidArgument for anything else.
std::optional<DType> parse_dtype(const std::string& text) {
  if (text == "auto") return std::nullopt;
  for (DType t : {DType::F32, DType::BF16, DType::F16})
    if (text == dtype_name(t)) return t;
  throw InvalidArgument("--dtype: got \"" + text + "\"; allowed: auto, fp32, bf16, fp16");
}

// The checkpoint's model config, checked against the slabs it holds.
model::LlamaConfig checkpoint_model(const ckpt::Checkpoint& c) {
  const std::string source = (c.dir() / "config.json").string();
  const model::LlamaConfig cfg = model::LlamaConfig::from_json(c.read_text("config.json"), source);
  const model::ModelLayout layout = model::make_layout(cfg, 1);
  const auto& units = c.manifest().units;
  if (units.size() != layout.units.size())
    throw CorruptData(fmt::format("{}: {} units, but {} describes {}", c.dir().string(),
                                  units.size(), source, layout.units.size()));
  for (size_t u = 0; u < units.size(); ++u) {
    if (units[u].numel != layout.units[u].numel)
      throw CorruptData(fmt::format("{}: unit {} holds {} elements, but {} needs {}",
                                    c.dir().string(), u, units[u].numel, source,
                                    layout.units[u].numel));
  }
  return cfg;
}

int run_export(const ExportArgs& a) {
  const auto start = std::chrono::steady_clock::now();
  // Ctrl-C from here on stops the export with exit 130 and nothing left at `out` (a signal
  // caught before this by catch_early_stop is its first).
  const StopSignals signals({});
  if (a.checkpoint.empty() || a.out.empty())
    throw InvalidArgument("export needs --checkpoint PATH and --out DIR");
  ckpt::ExportOptions options{.max_shard_bytes = parse_size(a.max_shard_size)};
  const std::optional<DType> dtype = parse_dtype(a.dtype);
  // Not into a checkpoint (it would hold a file its manifest does not list: never pruned, never
  // saved over), nor at a name a save directory writes.
  if (const std::optional<fs::path> in = ckpt::checkpoint_holding(export_target(a.out)))
    throw InvalidArgument(
        fmt::format("{}: inside checkpoint {}; export outside it", a.out, in->string()));
  if (const std::optional<fs::path> tree = swap::swap_tree_holding(export_target(a.out)))
    throw InvalidArgument(fmt::format(
        "{}: inside the swap directory {}, whose files are a training run's (the run's end "
        "removes what is there); export outside it",
        a.out, tree->string()));
  check_derived_name_fits(export_target(a.out).string(), kTemporarySuffix, "--out");
  if (ckpt::takes_a_save_name(export_target(a.out)))
    throw InvalidArgument(fmt::format(
        "{}: a name the save directory {} uses for its checkpoints; export under another name",
        a.out, export_target(a.out).parent_path().string()));
  ckpt::Checkpoint c = ckpt::Checkpoint::open(a.checkpoint);
  const model::LlamaConfig cfg = checkpoint_model(c);
  options.dtype = dtype.value_or(c.manifest().param_dtype);
  if (!a.no_verify) c.verify([] { return stop_flag().load(std::memory_order_relaxed); });
  throw_if_stopped();
  // Test hook (off in the shipped binary): a sleep before each piece is read, after the check
  // for a stop and a line in the piece log, so the command-line tests can signal an export in
  // the middle of writing.
  const TestHooks& hooks = test_hooks();
  auto read_master = [&c, &hooks](int unit, uint64_t begin, uint64_t count, float* out) {
    throw_if_stopped();  // write_hf_model then removes what it wrote
    if (hooks.export_piece_delay.count() > 0) {
      if (!hooks.export_piece_log.empty())
        std::ofstream(hooks.export_piece_log, std::ios::app) << "piece\n" << std::flush;
      std::this_thread::sleep_for(hooks.export_piece_delay);
    }
    c.read_slab(unit, ckpt::ArrayKind::kMaster, begin, count,
                std::as_writable_bytes(std::span(out, count)));
  };
  // A signal from here on makes the next piece read throw Interrupted, and write_hf_model
  // removes what it wrote (the StopSignals is made before the checkpoint is checked).
  // By absolute path: the export replaces the directory `out` names, which may be the working
  // directory itself (".").
  const fs::path target = export_target(a.out);
  remove_killed_exports(target);
  ckpt::write_hf_model(cfg, read_master, a.out, options);
  uint64_t bytes = 0;
  int files = 0;
  for (const fs::directory_entry& e : fs::directory_iterator(target)) {
    bytes += e.file_size();
    ++files;
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("exported %s (step %lld, %llu parameters, %s) to %s: %d files, %.1f MB in %.1f s\n",
              c.manifest().tag.c_str(), static_cast<long long>(c.manifest().step),
              static_cast<unsigned long long>(cfg.num_parameters()),
              std::string(dtype_name(options.dtype)).c_str(), a.out.c_str(), files, bytes / 1e6, s);
  return 0;
}

// Bad input exits 2, failures while writing exit 1.
int run_export_reporting(const ExportArgs& a) {
  catch_early_stop();
  start_delay_hook();
  return run_reporting([&] { return run_export(a); },
                       [&](const char* message) {
                         std::fprintf(stderr,
                                      "stopped: %s; the partial output was removed, nothing is "
                                      "left at %s\n",
                                      message, a.out.c_str());
                       });
}

}  // namespace

void add_export_command(CLI::App& app, int& rc) {
  auto a = std::make_shared<ExportArgs>();
  CLI::App* cmd = app.add_subcommand(
      "export",
      "Write a checkpoint's weights as a Hugging Face model directory (config.json + "
      "safetensors) under the model's own model_type: llama, mistral, qwen2 or qwen3");
  // `outcore export CKPT OUT_DIR`, or the same as --checkpoint / --out.
  cmd->add_option("checkpoint,--checkpoint", a->checkpoint,
                  "checkpoint directory, or save directory whose `latest` names one (required)");
  cmd->add_option("out,--out", a->out, "new or empty output directory (required)");
  cmd->add_option("--dtype", a->dtype,
                  "auto (the training parameter dtype), fp32 (the master weights exactly), bf16, "
                  "fp16 (default auto)");
  cmd->add_option("--max-shard-size", a->max_shard_size,
                  "split the weights into shards of at most this size (default 5GB)");
  cmd->add_flag("--no-verify", a->no_verify,
                "skip reading every checkpoint file whole for its CRC32C before exporting (sizes "
                "and each data file's header, its rank and step, are still checked)");
  cmd->callback([a, &rc] { rc = run_export_reporting(*a); });
}

}  // namespace outcore::cli
