// `outcore demo [--work-dir DIR] [--steps N] [--bf16]`: write the built-in demo dataset, the demo
// model's config.json and a ZeRO-Infinity DeepSpeed config (ZeRO-3, parameters and optimizer
// state in swap files under DIR, a device budget smaller than the training state) into DIR,
// then train on them, showing the tiers' traffic as it goes. Exit codes as `outcore train`.
#include <fmt/format.h>

#include <charconv>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <iterator>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "common/error.hpp"
#include "common/lock_file.hpp"
#include "common/open_file.hpp"
#include "engine/ckpt/ckpt.hpp"
#include "engine/config/config.hpp"
#include "engine/data/staged_file.hpp"
#include "engine/model/model.hpp"
#include "engine/train/demo_data.hpp"
#include "engine/train/trainer.hpp"
#include "tools/outcore/commands.hpp"
#include "tools/outcore/launch.hpp"
#include "tools/outcore/number_arg.hpp"
#include "tools/outcore/stop_signals.hpp"
#include "tools/outcore/train_session.hpp"

namespace outcore::cli {
namespace {

namespace fs = std::filesystem;

// The simulated device gets 64 MiB: well under the demo model's training state (10.5M
// parameters x 16 bytes = 160 MiB), enough for one micro-batch's activations (checkpoints on
// the host) and about two layers' parameters (stage3_max_live_parameters) and gradients.
constexpr int64_t kDemoDeviceMemoryMb = 64;
// Validation every kDemoEvalEvery steps over kDemoEvalBatches micro-batches.
constexpr int kDemoEvalEvery = 20, kDemoEvalBatches = 4;
constexpr int64_t kDemoMaxLiveParameters = 3'000'000;
constexpr int64_t kDemoDefaultSteps = 120;

struct DemoOptions {
  std::string work_dir = "build/demo";
  std::string steps;
  std::string trace;
  std::string device = "cpu";
  bool bf16 = false;  // bf16 parameters and compute (DeepSpeed's bf16.enabled)
};

// The demo's DeepSpeed config: the embedded stage-0 config moved to ZeRO-3 with parameters
// and optimizer state on NVMe (swap files under `swap_dir`).
nlohmann::ordered_json demo_config(int64_t steps, const std::string& swap_dir,
                                   const std::string& metrics_file, bool bf16) {
  nlohmann::ordered_json j = nlohmann::ordered_json::parse(train::demo_ds_config_json(steps));
  if (bf16) j["bf16"] = {{"enabled", true}};
  j["steps_per_print"] = 10;
  j["zero_optimization"] = {
      {"stage", 3},
      // max_in_cpu 0: every parameter partition in a swap file (DeepSpeed's default, 1e9
      // elements, would keep all of the demo model's in host memory).
      {"offload_param",
       {{"device", "nvme"}, {"nvme_path", swap_dir}, {"max_in_cpu", 0}, {"pin_memory", true}}},
      {"offload_optimizer", {{"device", "nvme"}, {"nvme_path", swap_dir}, {"pin_memory", true}}},
      {"stage3_prefetch_bucket_size", "auto"},
      {"stage3_param_persistence_threshold", "auto"},
      {"stage3_max_live_parameters", kDemoMaxLiveParameters},
      {"reduce_bucket_size", "auto"}};
  j["aio"] = {{"block_size", 1048576},
              {"queue_depth", 8},
              {"single_submit", false},
              {"overlap_events", true}};
  j["activation_checkpointing"] = {{"cpu_checkpointing", true}};
  j["outcore"] = {{"device_memory_mb", kDemoDeviceMemoryMb}, {"metrics_file", metrics_file}};
  return j;
}

// Written first into every work directory the demo uses, and rewritten around each file the
// demo writes: its first line, then a line per file, "file <name> <digest>" once written
// (file_digest) or "writing <name>" while it is. A file at one of the demo's names is the
// demo's to replace only as the marker records it: being written, or with the digest it had
// when written (a file the user changed or put there since is kept). The metrics file is
// checked by the run itself (it replaces only a metrics file).
constexpr const char* kDemoMarker = ".outcore-demo";
constexpr const char* kDemoLock = ".demo.lock";
constexpr const char* kDemoSwap = "swap";
constexpr const char* kDemoMarkerFirstLine = "outcore demo work directory";
constexpr const char* kDemoMetrics = "metrics.jsonl";
constexpr const char* kDemoNames[] = {"config.json", "ds_config.json", kDemoMetrics,
                                      "demo_train.bin", "demo_val.bin"};

// A file's size and the CRC32C of its bytes (the checkpoints' checksum), "<size>:<crc>"; empty
// when unreadable.
std::string file_digest(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return {};
  uint32_t crc = 0;
  uint64_t size = 0;
  std::vector<char> buf(1 << 16);
  while (in) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    const auto n = static_cast<size_t>(in.gcount());
    crc = ckpt::crc32c(std::as_bytes(std::span(buf.data(), n)), crc);
    size += n;
  }
  if (in.bad()) return {};
  return fmt::format("{}:{:08x}", size, crc);
}

// What a work directory's marker says. `listed`: it records its files (an earlier version's
// marker, its first line alone, makes every file at the demo's names the demo's).
struct DemoMarker {
  bool exists = false;
  bool listed = false;
  std::vector<std::pair<std::string, std::string>> files;  // name, digest ("": being written)

  const std::string* digest(const std::string& name) const {
    for (const auto& [n, d] : files)
      if (n == name) return &d;
    return nullptr;
  }
  void set(const std::string& name, const std::string& digest) {
    for (auto& [n, d] : files)
      if (n == name) {
        d = digest;
        return;
      }
    files.emplace_back(name, digest);
  }
  std::string text() const {
    std::string t = std::string(kDemoMarkerFirstLine) + "\n";
    for (const auto& [n, d] : files)
      t += d.empty() ? fmt::format("writing {}\n", n) : fmt::format("file {} {}\n", n, d);
    return t;
  }
};

DemoMarker read_marker(const fs::path& dir) {
  DemoMarker m;
  std::error_code ec;
  if (!fs::is_regular_file(fs::symlink_status(dir / kDemoMarker, ec))) return m;
  m.exists = true;
  std::ifstream in(dir / kDemoMarker, std::ios::binary);
  std::string line;
  std::getline(in, line);  // the first line
  while (std::getline(in, line)) {
    const size_t sp = line.find(' ');
    const std::string word = line.substr(0, sp);
    const std::string rest = sp == std::string::npos ? std::string() : line.substr(sp + 1);
    if (word == "writing" && !rest.empty()) {
      m.set(rest, "");
    } else if (word == "file") {
      const size_t sp2 = rest.find(' ');
      if (sp2 == std::string::npos) continue;
      m.set(rest.substr(0, sp2), rest.substr(sp2 + 1));
    }
  }
  // An earlier version's marker holds its first line alone; this version's lists a file as soon
  // as it writes one.
  m.listed = !m.files.empty();
  return m;
}

// Empty when the demo may write its files into `dir` (missing, or a directory where nothing at
// the demo's names is someone else's); otherwise why not. A directory is the demo's when it
// holds the marker, or (written before the marker existed) the demo's own model config; a
// listing marker decides file by file. A symbolic link at one of the names is refused anywhere:
// it is never written through.
std::string work_dir_problem(const fs::path& dir) {
  std::error_code ec;
  if (fs::symlink_status(dir, ec).type() == fs::file_type::not_found) return {};
  if (!fs::is_directory(dir, ec)) return "is not a directory";
  if (const fs::file_type t = fs::symlink_status(dir / kDemoMarker, ec).type();
      t != fs::file_type::not_found && t != fs::file_type::regular)
    return fmt::format("holds {}, which is not the demo's marker (a regular file)", kDemoMarker);
  const DemoMarker marker = read_marker(dir);
  bool owned = marker.exists;
  if (!owned && fs::is_regular_file(fs::symlink_status(dir / "config.json", ec))) {
    std::ifstream in(dir / "config.json", std::ios::binary);
    const std::string text{std::istreambuf_iterator<char>(in), {}};
    owned = text == train::demo_model_config_json();
  }
  for (const char* name : kDemoNames) {
    const fs::file_type t = fs::symlink_status(dir / name, ec).type();
    if (t == fs::file_type::not_found) continue;
    if (t == fs::file_type::symlink)
      return fmt::format("holds {}, a symbolic link where the demo writes a file of its own", name);
    if (!owned || t != fs::file_type::regular)
      return fmt::format("holds {}, which the demo did not write", name);
    if (!marker.listed || name == std::string(kDemoMetrics)) continue;
    const std::string* recorded = marker.digest(name);
    if (recorded == nullptr) return fmt::format("holds {}, which the demo did not write", name);
    if (!recorded->empty() && file_digest(dir / name) != *recorded)
      return fmt::format("holds {}, changed since the demo wrote it", name);
  }
  return {};
}

// Replaces `path` with `text` through a temporary of its own, created exclusively, and a rename:
// a link at `path` is replaced, never written through, and a file at a temporary's name (a
// user's) is never touched.
void write_text(const fs::path& path, const std::string& text) {
  data::StagedFile out(path.string());
  out.append(text.data(), text.size());
  out.finish();
  out.commit();
}

int run_demo(const DemoOptions& o) {
  catch_early_stop();
  int64_t steps = kDemoDefaultSteps;
  if (!o.steps.empty()) {
    std::string allowed = parse_number_arg(o.steps, steps);
    if (allowed.empty() && steps < 1) allowed = "allowed: a number >= 1";
    if (!allowed.empty()) {
      std::fprintf(stderr, "error: --steps: got \"%s\"; %s\n", o.steps.c_str(), allowed.c_str());
      return 2;
    }
  }
  // The device and the trace path before anything is written.
  const std::optional<DeviceChoice> device = choose_device(o.device);
  if (!device) return 2;
  const fs::path dir = fs::absolute(o.work_dir);
  const fs::path model_path = dir / "config.json", config_path = dir / "ds_config.json";
  const fs::path metrics_path = dir / "metrics.jsonl", swap_dir = dir / kDemoSwap;
  if (const std::string problem = work_dir_problem(dir); !problem.empty()) {
    std::fprintf(stderr, "error: --work-dir %s %s: move it away or choose another work directory\n",
                 o.work_dir.c_str(), problem.c_str());
    return 2;
  }
  // Not in a checkpoint, nor at a save directory's names: a file there would keep that
  // checkpoint forever, or block a later save of that name.
  if (!check_outside_checkpoints(dir.string(), "--work-dir", "") ||
      !check_outside_checkpoints(o.trace, "--trace", ""))
    return 2;
  if (!check_not_a_save_name(dir.string(), "--work-dir") ||
      !check_not_a_save_name(o.trace, "--trace"))
    return 2;
  std::vector<std::pair<std::string, const char*>> outputs;
  for (const char* name : kDemoNames) outputs.emplace_back((dir / name).string(), "the demo's");
  for (const char* name : {kDemoMarker, kDemoLock, kDemoSwap})
    outputs.emplace_back((dir / name).string(), "the demo's");
  if (!check_output_file(o.trace, "--trace", outputs, "a file of the demo") ||
      !check_replaces_only_a_trace(o.trace, "--trace"))
    return 2;
  // Nor in its swap directory, whose files it removes.
  if (!o.trace.empty()) {
    if (!path_within(resolve_links(o.trace), swap_dir.string()).empty()) {
      std::fprintf(stderr,
                   "error: --trace %s: inside the demo's swap directory %s; choose a path "
                   "outside it\n",
                   o.trace.c_str(), swap_dir.string().c_str());
      return 2;
    }
  }
  train::DemoDatasetFiles data;
  config::Config cfg;
  model::LlamaConfig model;
  // A Ctrl-C while the files are written stops the demo after them, with no temporary left (a
  // second one removes them at once).
  std::optional<StopSignals> signals(std::in_place, StopSignals::Options{});
  // One demo at a time in a work directory, from before its first file to the end of the run: a
  // second one would rewrite the config the first one's "same run by hand" names.
  std::optional<LockFile> lock;
  try {
    fs::create_directories(dir);
    lock.emplace(dir / kDemoLock,
                 "lock the demo's work directory (another demo is running in it: give each its "
                 "own --work-dir)",
                 "outcore demo lock\n", /*register_cleanup=*/true);
    std::fprintf(stderr, "writing the demo dataset, model and DeepSpeed config to %s\n",
                 dir.string().c_str());
    // Each file recorded as being written, then with its digest once it is.
    DemoMarker marker = read_marker(dir);
    // An earlier version's marker (or none): the files at the demo's names passed as the demo's
    // (work_dir_problem), and are recorded as they are, so that a demo stopped while it writes
    // leaves every one of them recorded.
    if (!marker.listed)
      for (const char* name : kDemoNames)
        if (name != std::string(kDemoMetrics) &&
            fs::is_regular_file(fs::symlink_status(dir / name)))
          marker.set(name, file_digest(dir / name));
    auto writing = [&](std::initializer_list<const char*> names, auto&& write) {
      for (const char* name : names) marker.set(name, "");
      write_text(dir / kDemoMarker, marker.text());
      write();
      for (const char* name : names) marker.set(name, file_digest(dir / name));
      write_text(dir / kDemoMarker, marker.text());
    };
    writing({"demo_train.bin", "demo_val.bin"},
            [&] { data = train::write_demo_dataset(dir.string()); });
    writing({"config.json"}, [&] { write_text(model_path, train::demo_model_config_json()); });
    writing({"ds_config.json"}, [&] {
      write_text(
          config_path,
          demo_config(steps, swap_dir.string(), metrics_path.string(), o.bf16).dump(2) + "\n");
    });
    model = model::LlamaConfig::load(model_path);
    cfg = config::load_config_file(config_path.string()).config;
    config::AutoContext ctx;
    ctx.hidden_size = model.hidden_size;
    ctx.total_steps = steps;
    config::resolve_auto(cfg, ctx);
  } catch (const ConfigError& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  } catch (const PathBusy& e) {  // another demo holds the work directory
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  } catch (const fs::filesystem_error& e) {  // cannot make the work directory
    return report_filesystem_error(e, "--work-dir ");
  } catch (const IoError& e) {  // cannot write there: 2 for what the path given makes
    std::fprintf(stderr, "error: --work-dir %s: %s\n", o.work_dir.c_str(), e.what());
    return exit_code_of(e.error_number());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  signals.reset();  // run_training installs its own
  if (stop_flag().load()) {
    std::fprintf(stderr, "stopped before training: the demo's files in %s are whole\n",
                 dir.string().c_str());
    return kExitInterrupted;
  }
  std::printf(
      "outcore demo: a %s-parameter Llama trained with ZeRO-3, parameters and optimizer state "
      "in NVMe swap files, in %s, on %s with a %lld MiB budget.\n"
      "The same run by hand:\n  outcore train --config %s --model %s --data %s --val-data %s "
      "--seq-len %lld --steps %lld --eval-every %d --eval-batches %d\n",
      fmt::format("{:.1f}M", static_cast<double>(model.num_parameters()) / 1e6).c_str(),
      o.bf16 ? "bf16 (fp32 master weights and optimizer state)" : "fp32",
      device->description.c_str(), static_cast<long long>(kDemoDeviceMemoryMb), config_path.c_str(),
      model_path.c_str(), data.train.c_str(), data.val.c_str(),
      static_cast<long long>(train::kDemoSeqLen), static_cast<long long>(steps), kDemoEvalEvery,
      kDemoEvalBatches);
  std::fflush(stdout);

  train::TrainerOptions t;
  t.device = device->kind;
  t.gpu = device->gpu;
  t.train_data = data.train;
  t.val_data = data.val;
  t.steps = steps;
  t.seq_len = train::kDemoSeqLen;
  t.eval_every = kDemoEvalEvery;
  t.eval_batches = kDemoEvalBatches;
  t.trace_file = o.trace;
  return run_training(cfg, model, std::move(t), config_path.string());
}

}  // namespace

void add_demo_command(CLI::App& app, int& rc) {
  auto o = std::make_shared<DemoOptions>();
  CLI::App* cmd = app.add_subcommand(
      "demo",
      "Train the built-in demo: a 10.5M-parameter byte-level Llama on generated English-like "
      "text, with ZeRO-3 and parameters and optimizer state swapped to NVMe under the work "
      "directory. Needs no download; the loss falls within a couple of minutes on 2 cores.");
  cmd->add_option("--work-dir", o->work_dir,
                  "where the data, configs, metrics and swap files go (default: build/demo)");
  cmd->add_option("--steps", o->steps,
                  fmt::format("optimizer steps (default {})", kDemoDefaultSteps));
  cmd->add_option("--trace", o->trace,
                  "Chrome trace-event JSON of the run (open in Perfetto or chrome://tracing)");
  cmd->add_option("--device", o->device,
                  "cpu (the simulated device, default), cuda (the GPU: the whole GPU path in one "
                  "command), auto");
  cmd->add_flag("--bf16", o->bf16,
                "bf16 parameters and compute (bf16.enabled in the DeepSpeed config): GEMMs on bf16 "
                "operands with fp32 accumulation, fused attention on a GPU's tensor cores");
  cmd->callback([o, &rc] { rc = run_demo(*o); });
}

}  // namespace outcore::cli
