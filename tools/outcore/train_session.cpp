#include "tools/outcore/train_session.hpp"

#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <thread>

#include "common/cleanup.hpp"
#include "common/error.hpp"
#include "common/open_file.hpp"
#include "common/trace.hpp"
#include "engine/ckpt/ckpt.hpp"
#include "engine/train/loss_scaler.hpp"
#include "engine/zero/plan.hpp"
#include "swap/swap.hpp"
#include "tools/outcore/stop_signals.hpp"
#include "tools/outcore/test_hooks.hpp"

namespace outcore::cli {

int exit_code_of(int error_number) {
  switch (error_number) {
    case EACCES:
    case EPERM:
    case EROFS:
    case ELOOP:
    case ENAMETOOLONG:
    case ENOTDIR:
    case EISDIR:
    case ENOENT:
      return 2;
    default:
      return 1;
  }
}

int report_filesystem_error(const std::filesystem::filesystem_error& e, std::string_view prefix) {
  std::string paths = e.path1().string();
  if (!e.path2().empty()) paths += ", " + e.path2().string();
  std::fprintf(stderr, "error: %.*s%s: %s\n", static_cast<int>(prefix.size()), prefix.data(),
               paths.c_str(), e.code().message().c_str());
  const bool os_error = e.code().category() == std::generic_category() ||
                        e.code().category() == std::system_category();
  return os_error ? exit_code_of(e.code().value()) : 1;
}

int run_reporting(const std::function<int()>& run,
                  const std::function<void(const char* message)>& on_stop) {
  try {
    return run();
  } catch (const Interrupted& e) {
    on_stop(e.what());
    return kExitInterrupted;
  } catch (const ConfigError& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  } catch (const InvalidArgument& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  } catch (const CorruptData& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  } catch (const PathBusy& e) {  // a path another run holds: the user's to change, as in train
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  } catch (const IoError& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return exit_code_of(e.error_number());
  } catch (const std::filesystem::filesystem_error& e) {
    return report_filesystem_error(e, "");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}

namespace {

// "rank r of W: " before every error of a data-parallel rank.
std::string g_rank_prefix;

void print_error(const std::exception& e) {
  std::fprintf(stderr, "error: %s%s\n", g_rank_prefix.c_str(), e.what());
}

// Under mpirun the launcher kills the ranks a moment after it tells them to stop, and a
// rank blocked in a collective cannot stop on its own: as soon as a stop is requested this
// thread removes the swap files (open descriptors keep working, so a clean stop still can), not
// the locks (rank 0 may still save).
class SwapFileGuard {
 public:
  explicit SwapFileGuard(bool active) {
    if (!active) return;
    thread_ = std::thread([this] {
      while (!done_.load()) {
        // Again while the process goes on: files made after a stop (the engine still being
        // made) go too. Locks stay: see cleanup.hpp.
        if (stop_flag().load()) cleanup::remove_registered_files(cleanup::Scope::kData);
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    });
  }
  ~SwapFileGuard() {
    done_.store(true);
    if (thread_.joinable()) thread_.join();
  }
  SwapFileGuard(const SwapFileGuard&) = delete;
  SwapFileGuard& operator=(const SwapFileGuard&) = delete;

 private:
  std::atomic<bool> done_{false};
  std::thread thread_;
};

}  // namespace

int fail_job(comm::Comm* comm, int code) {
  if (comm == nullptr || comm->world_size() == 1) return code;
  cleanup::remove_registered_files();
  std::fflush(stdout);
  std::fflush(stderr);
  comm->abort(code);
  return code;
}

namespace {

void print_result(const train::TrainResult& r) {
  std::string s =
      fmt::format("{} {} steps ({} skipped) in {:.1f} s: {:.0f} tokens/s, {:.2f} GFLOP/s\n",
                  r.stopped ? "stopped after" : "trained", r.steps, r.skipped_steps, r.wall_s,
                  r.tokens_per_s, r.gflops_per_s);
  if (!r.losses.empty()) {
    // Over the steps that trained on a target: a step whose loss mask left none has no loss
    // (its 0 is no figure of the model).
    const auto has = [&](size_t i) { return i >= r.targets.size() || r.targets[i] > 0; };
    size_t first = 0, last = r.losses.size();
    while (first < r.losses.size() && !has(first)) ++first;
    while (last > first && !has(last - 1)) --last;
    if (first == r.losses.size()) {
      s += "loss: none (the loss mask left no target in any step)";
    } else {
      s += fmt::format("loss {:.4f} -> {:.4f}", r.losses[first], r.losses[last - 1]);
      if (first > 0 || last < r.losses.size())
        s += " (first and last steps with a target: the loss mask left none in the others)";
    }
    if (r.final_val_loss) s += fmt::format(" (validation {:.4f})", *r.final_val_loss);
    s += "\n";
  }
  if (r.in_backward_committed + r.in_backward_redone + r.in_backward_restored > 0)
    s += fmt::format(
        "optimizer step during backward (outcore.step_in_backward): {} stood, {} redone after "
        "clipping, {} undone after an overflow\n",
        r.in_backward_committed, r.in_backward_redone, r.in_backward_restored);
  s += fmt::format(
      "device memory peak {}{}\n", zero::format_bytes(r.memory.device_peak_bytes),
      r.memory.device_budget_bytes > 0
          ? fmt::format(" of a {} budget", zero::format_bytes(r.memory.device_budget_bytes))
          : std::string());
  if (r.memory.pinned_peak_bytes > 0) {
    s +=
        fmt::format("pinned host memory peak {}\n", zero::format_bytes(r.memory.pinned_peak_bytes));
  }
  const zero::TrafficStats& t = r.traffic;
  s += fmt::format(
      "traffic    nvme read {} write {}, host->device {}, device->host {} (the whole run, the "
      "training state's initialisation included)\n",
      zero::format_bytes(t.nvme_read_bytes), zero::format_bytes(t.nvme_write_bytes),
      zero::format_bytes(t.h2d_bytes), zero::format_bytes(t.d2h_bytes));
  if (r.trace && r.trace->under_compute.io_busy_s <= 0) {
    s += fmt::format("trace      {} ({} spans): no I/O to hide\n", r.trace->path, r.trace->events);
  } else if (r.trace) {
    s += fmt::format(
        "trace      {} ({} spans): I/O busy {:.2f} s, {:.1f}% hidden under forward/backward, "
        "{:.1f}% under forward/backward or Adam\n",
        r.trace->path, r.trace->events, r.trace->under_compute.io_busy_s,
        100 * r.trace->under_compute.hidden_fraction,
        100 * r.trace->under_compute_or_optimizer.hidden_fraction);
  }
  std::fputs(s.c_str(), stdout);
  std::fflush(stdout);
}

}  // namespace

bool check_input_file(const std::string& path, const char* flag, const std::string& hint) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::file_status st = fs::status(path, ec);
  std::string reason;
  if (ec || !fs::exists(st)) {
    reason = ec && ec != std::errc::no_such_file_or_directory ? ec.message() : "no such file";
  } else if (struct stat raw{}; !fs::is_regular_file(st) && ::stat(path.c_str(), &raw) == 0) {
    reason = std::string("is ") + file_kind(raw.st_mode) + ", not a regular file";
  } else if (!fs::is_regular_file(st)) {
    reason = "not a regular file";
  } else if (::access(path.c_str(), R_OK) != 0) {
    reason = std::strerror(errno);
  }
  if (reason.empty()) return true;
  std::fprintf(stderr, "error: %s %s: %s%s%s\n", flag, path.c_str(), reason.c_str(),
               hint.empty() ? "" : "; ", hint.c_str());
  return false;
}

bool check_output_file(const std::string& path, const char* flag,
                       const std::vector<std::pair<std::string, const char*>>& inputs,
                       const char* what) {
  namespace fs = std::filesystem;
  if (path.empty()) return true;
  std::error_code ec;
  struct stat out {};
  const bool exists = ::stat(path.c_str(), &out) == 0;
  if (exists && !S_ISREG(out.st_mode)) {
    std::fprintf(stderr, "error: %s %s: is %s, not a regular file\n", flag, path.c_str(),
                 file_kind(out.st_mode));
    return false;
  }
  // The file this process's stdout or stderr writes to (`> log.txt`, /dev/stdout, /dev/fd/1):
  // replaced or truncated, it would lose the run's own output.
  for (const int fd : {STDOUT_FILENO, STDERR_FILENO}) {
    struct stat stream {};
    if (exists && ::fstat(fd, &stream) == 0 && stream.st_dev == out.st_dev &&
        stream.st_ino == out.st_ino) {
      std::fprintf(stderr, "error: %s %s: is the file this command's %s writes to; name another\n",
                   flag, path.c_str(), fd == STDOUT_FILENO ? "stdout" : "stderr");
      return false;
    }
  }
  for (const auto& [in_path, in_flag] : inputs) {
    if (same_file(path, in_path)) {
      std::fprintf(stderr, "error: %s %s is the same file as %s %s; refusing to overwrite %s\n",
                   flag, path.c_str(), in_flag, in_path.c_str(), what);
      return false;
    }
  }
  // Where the file is written: beside what a link names (trace::write_json, metrics).
  fs::path dir = fs::path(resolve_links(path)).parent_path();
  if (dir.empty()) dir = ".";
  if (!fs::is_directory(dir, ec) || ::access(dir.c_str(), W_OK | X_OK) != 0) {
    const char* why = !fs::exists(dir, ec)         ? "does not exist"
                      : !fs::is_directory(dir, ec) ? "is not a directory"
                                                   : "is not writable";
    std::fprintf(stderr, "error: %s %s: %s %s\n", flag, path.c_str(), dir.c_str(), why);
    return false;
  }
  return true;
}

namespace {

// "" for a path that is not a link, else " (through a link to TARGET)": a file is written
// through a link at its name, whose target need not exist yet (resolve_links).
std::string link_note(const std::string& path, const std::string& target) {
  return target == path ? std::string() : " (through a link to " + target + ")";
}

}  // namespace

bool check_outside_checkpoints(const std::string& path, const char* flag,
                               const std::string& save_dir) {
  namespace fs = std::filesystem;
  if (path.empty()) return true;
  const std::string target = resolve_links(path);  // where the file is written
  if (const std::optional<fs::path> in = ckpt::checkpoint_holding(target)) {
    std::fprintf(stderr,
                 "error: %s %s%s: inside checkpoint %s (a file it does not list keeps it from "
                 "ever being pruned or saved over); choose a path outside it\n",
                 flag, path.c_str(), link_note(path, target).c_str(), in->string().c_str());
    return false;
  }
  if (save_dir.empty()) return true;
  const std::string rel = path_within(target, save_dir);
  if (rel.empty()) return true;
  const std::string first = fs::path(rel).begin()->string();
  if (first != "." && !ckpt::is_save_entry_name(first)) return true;
  std::fprintf(stderr,
               "error: %s %s%s: --save-dir %s writes there (its checkpoints, latest, .lock); "
               "choose a path outside them\n",
               flag, path.c_str(), link_note(path, target).c_str(), save_dir.c_str());
  return false;
}

bool check_not_a_save_name(const std::string& path, const char* flag) {
  if (path.empty()) return true;
  const std::string target = resolve_links(path);
  if (!ckpt::takes_a_save_name(std::filesystem::absolute(target))) return true;
  std::fprintf(stderr,
               "error: %s %s%s: a name that a save directory writes (a checkpoint, latest): "
               "choose another\n",
               flag, path.c_str(), link_note(path, target).c_str());
  return false;
}

namespace {

// The swap paths of `cfg` that act (offload_param / offload_optimizer nvme_path at stage 3, not
// empty), with their config keys.
std::vector<std::pair<const char*, std::string>> acting_swap_paths(const config::Config& cfg) {
  const config::ZeroConfig& z = cfg.zero_optimization;
  std::vector<std::pair<const char*, std::string>> out;
  if (z.stage != 3) return out;
  if (z.offload_param.device == config::OffloadDevice::kNvme && !z.offload_param.nvme_path.empty())
    out.emplace_back("zero_optimization.offload_param.nvme_path", z.offload_param.nvme_path);
  if (z.offload_optimizer.device == config::OffloadDevice::kNvme &&
      !z.offload_optimizer.nvme_path.empty())
    out.emplace_back("zero_optimization.offload_optimizer.nvme_path",
                     z.offload_optimizer.nvme_path);
  return out;
}

}  // namespace

bool check_swap_paths_outside_saves(const config::Config& cfg, const std::string& save_dir) {
  namespace fs = std::filesystem;
  for (const auto& [key, swap] : acting_swap_paths(cfg)) {
    const std::string* path = &swap;
    const std::string at = resolved_path(*path);
    if (at.empty()) {
      if (!check_outside_checkpoints(*path, key, save_dir)) return false;
      continue;
    }
    // The save directory itself may hold the swap files; its save names, or a path below one,
    // may not.
    const bool save_dir_itself = !save_dir.empty() && path_within(save_dir, at) == ".";
    if (!save_dir_itself && !check_outside_checkpoints(*path, key, save_dir)) return false;
    // Nor the save directory inside the swap directory (outcore_swap/: its rank and kind
    // directories, each with its .lock).
    if (!save_dir.empty() && !path_within(save_dir, at + "/outcore_swap").empty()) {
      std::fprintf(stderr,
                   "error: --save-dir %s: inside the swap directory %s/outcore_swap of %s %s; "
                   "save elsewhere\n",
                   save_dir.c_str(), path->c_str(), key, path->c_str());
      return false;
    }
    for (fs::path p = at; p.has_relative_path(); p = p.parent_path()) {
      if (!ckpt::takes_a_save_name(p)) continue;
      std::fprintf(stderr,
                   "error: %s %s: %s%s is a name that a save directory writes (a checkpoint, "
                   "latest); choose a swap path outside it\n",
                   key, path->c_str(), p == fs::path(at) ? "" : "below ", p.string().c_str());
      return false;
    }
  }
  return true;
}

bool check_outputs_outside_swap(const config::Config& cfg,
                                const std::vector<std::pair<std::string, const char*>>& outputs) {
  for (const auto& [key, swap] : acting_swap_paths(cfg)) {
    const std::string tree = resolved_path(swap + "/outcore_swap");
    if (tree.empty()) continue;
    for (const auto& [out, flag] : outputs) {
      if (out.empty()) continue;
      const std::string target = resolve_links(out);  // where the file is written
      if (path_within(target, tree).empty()) continue;
      std::fprintf(stderr,
                   "error: %s %s%s: inside the swap directory %s of %s (the run removes files "
                   "there as stale swap files); choose a path outside it\n",
                   flag, out.c_str(), link_note(out, target).c_str(), tree.c_str(), key);
      return false;
    }
  }
  return true;
}

bool check_outside_swap_trees(const std::string& path, const char* flag) {
  if (path.empty()) return true;
  const std::string target = resolve_links(path);  // where the file is written
  const std::optional<std::filesystem::path> tree = swap::swap_tree_holding(target);
  if (!tree) return true;
  std::fprintf(stderr,
               "error: %s %s%s: inside the swap directory %s, whose files are a training run's (a "
               "run's swap file of that name replaces it, and the run's end removes it); choose a "
               "path outside it\n",
               flag, path.c_str(), link_note(path, target).c_str(), tree->string().c_str());
  return false;
}

bool check_replaces_only_a_trace(const std::string& path, const char* flag) {
  if (path.empty()) return true;
  try {
    check_derived_name_fits(path, kTemporarySuffix, flag);
  } catch (const InvalidArgument& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return false;
  }
  if (trace::holds_trace_or_nothing(path)) return true;
  std::fprintf(stderr,
               "error: %s %s: exists and is not a trace file: a run replaces only a trace; move "
               "it away or name another file\n",
               flag, path.c_str());
  return false;
}

int run_training(const config::Config& cfg, const model::LlamaConfig& model,
                 train::TrainerOptions options, const std::string& config_file) {
  comm::Comm* comm = options.comm;
  const int rank = comm != nullptr ? comm->rank() : 0;
  const int world = comm != nullptr ? comm->world_size() : 1;
  // Installed before the engine creates its swap files, so that Ctrl-C at any point ends
  // with the Trainer destroyed (and the files removed) rather than killed. Under mpirun the
  // signal may be the job's end after another rank failed, which kills the rank a second later.
  const std::string notice =
      options.save_dir.empty()
          ? std::string("\nstopping after the current step") +
                (world > 1 ? " (unless mpirun is ending the job after a rank failed)" : "") +
                " (press Ctrl-C again to abort at once)\n"
          : std::string("\nstopping after the current step and saving a checkpoint") +
                (world > 1 ? " (unless mpirun is ending the job after a rank failed)" : "") +
                " (press Ctrl-C again to abort at once: nothing more is saved, the last "
                "checkpoint completed is kept)\n";
  const StopSignals signals(
      {.notice = notice.c_str(), .mpirun_stop = true, .ignore_sigpipe = true});
  options.stop_requested = &stop_flag();
  g_rank_prefix = world > 1 ? fmt::format("rank {} of {}: ", rank, world) : std::string();
  if (rank != 0) options.progress_out = nullptr;  // rank 0 speaks for the job
  // Under mpirun (any world size: mpirun kills a single rank a second after SIGTERM too).
  const bool launched = world > 1 || std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr;
  SwapFileGuard guard(launched);
  if (launched) end_with_launcher();  // a rank never trains on unsupervised
  std::unique_ptr<train::Trainer> trainer;
  try {
    trainer = std::make_unique<train::Trainer>(cfg, model, std::move(options));
  } catch (const Interrupted& e) {  // Ctrl-C while the engine was being initialised
    std::fprintf(stderr, "stopped: %s%s\n", g_rank_prefix.c_str(), e.what());
    return fail_job(comm, kExitInterrupted);
  } catch (const ConfigError& e) {  // config, model config
    std::fprintf(stderr, "error: %s%s\n", g_rank_prefix.c_str(),
                 config::message_naming_config_file(e, config_file).c_str());
    return fail_job(comm, 2);
  } catch (const InvalidArgument& e) {  // options, data too short
    print_error(e);
    return fail_job(comm, 2);
  } catch (const CorruptData& e) {  // bad token file, token outside the vocabulary
    print_error(e);
    return fail_job(comm, 2);
  } catch (const OutOfMemory& e) {  // the plan does not fit a tier
    print_error(e);
    return fail_job(comm, 2);
  } catch (const PathBusy& e) {  // a path another run holds (its lock) is the user's to change
    print_error(e);
    return fail_job(comm, 2);
  } catch (const IoError& e) {  // a save directory, swap path or output the run cannot write
    print_error(e);
    return fail_job(comm, exit_code_of(e.error_number()));
  } catch (const std::filesystem::filesystem_error& e) {  // a path it could not look at
    return fail_job(comm, report_filesystem_error(e, g_rank_prefix));
  } catch (const std::exception& e) {  // a failing drive creating swap files, ...
    print_error(e);
    return fail_job(comm, 1);
  }
  if (stop_flag().load()) {  // interrupted while setting up
    trainer.reset();
    return fail_job(comm, kExitInterrupted);
  }
  if (rank == 0) {
    std::fputs(trainer->summary().c_str(), stdout);
    std::fflush(stdout);
  }
  try {
    train::TrainResult r = trainer->run();
    if (r.stopped && test_hooks().stop_delay.count() > 0)
      std::this_thread::sleep_for(test_hooks().stop_delay);
    trainer.reset();  // removes the swap files before the result is printed
    if (rank == 0) print_result(r);
    if (!r.metrics_error.empty())  // trained and saved, but the metrics are incomplete
      std::fprintf(stderr, "error: %sthe metrics file is incomplete: %s\n", g_rank_prefix.c_str(),
                   r.metrics_error.c_str());
    if (!r.trace_error.empty())  // trained and saved, but no trace
      std::fprintf(stderr, "error: %sthe trace was not written: %s\n", g_rank_prefix.c_str(),
                   r.trace_error.c_str());
    if (r.stopped) return kExitInterrupted;  // what scripts tell an interruption by
    return r.metrics_error.empty() && r.trace_error.empty() ? 0 : 1;
  } catch (const std::exception& e) {
    print_error(e);
    return fail_job(comm, 1);
  }
}

}  // namespace outcore::cli
