// Running a Trainer from the command line, shared by `outcore train` and `outcore demo`:
// exit codes, Ctrl-C, and what goes to stdout and stderr.
#pragma once

#include <filesystem>
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "engine/config/config.hpp"
#include "engine/model/model.hpp"
#include "engine/train/trainer.hpp"

namespace outcore::cli {

// Exit code after a run stopped cleanly by SIGINT / SIGTERM (128 + SIGINT, as shells do).
inline constexpr int kExitInterrupted = 130;

// Runs a command's `run` and turns what it throws into one line on stderr and an exit code:
// Interrupted -> `on_stop(message)` prints its line, kExitInterrupted; ConfigError,
// InvalidArgument, CorruptData (bad input), PathBusy (a path another run holds), an IoError the
// path given makes (EACCES, EPERM, EROFS, ELOOP, ENAMETOOLONG, ENOTDIR, EISDIR, ENOENT) ->
// "error: ...", 2 (so is a std::filesystem error for such a path); anything else (a failing drive,
// a full disk) -> "error: ...", 1. What `run` returns is returned as is. A path the standard
// library could not look at (a name too long, no permission): "error: <prefix><path>: <reason>" on
// stderr; returns the exit code an IoError of that errno gets (2 for what the path given makes,
// else 1).
int report_filesystem_error(const std::filesystem::filesystem_error& e, std::string_view prefix);

// The exit code of an I/O error of `error_number`: 2 for what the path given makes (no
// permission, a read-only filesystem, a link loop, a name too long, a file where a directory
// belongs, a missing directory), 1 for others (a failing drive, a full disk).
int exit_code_of(int error_number);

int run_reporting(const std::function<int()>& run,
                  const std::function<void(const char* message)>& on_stop);

// Returns true when `path` names a readable regular file; otherwise prints
// "error: <flag> <path>: <reason>[; <hint>]" on stderr and returns false.
bool check_input_file(const std::string& path, const char* flag, const std::string& hint = "");

// Output paths must not destroy inputs and must be creatable. Returns true when `path` (an
// output file named by `flag`) is a regular file or not there yet, is not the same file
// (device and inode, or the same path for files not made yet) as any of `inputs` ((path,
// flag) pairs; empty paths skipped), and its directory exists and is writable; otherwise
// prints one "error:" line naming both and returns false (exit 2). `what` names what `inputs`
// are in that line.
bool check_output_file(const std::string& path, const char* flag,
                       const std::vector<std::pair<std::string, const char*>>& inputs,
                       const char* what = "an input");

// False (with one error line naming `flag`) when `path` lies in an outcore checkpoint (any:
// ckpt::checkpoint_holding), or where a save into `save_dir` writes: `latest`, `latest.tmp`,
// `.lock`, or a `global_step<N>` entry or anything in one (a save would replace it). Other paths
// in the save directory are the user's and fine.
bool check_outside_checkpoints(const std::string& path, const char* flag,
                               const std::string& save_dir);
// False (with one error line naming `flag`) when `path` lies in a swap directory's tree
// (swap::swap_tree_holding: outcore_swap/ of any nvme_path), where a run's swap files and its
// cleanup would replace or remove it.
bool check_outside_swap_trees(const std::string& path, const char* flag);
// False (with one error line naming `flag`) when `path` is a name a save directory writes
// (ckpt::takes_a_save_name: a checkpoint, `latest`, ... in a directory of checkpoints).
bool check_not_a_save_name(const std::string& path, const char* flag);

// False (with one error line naming the config key) when a swap path of `cfg` that acts
// (offload_param / offload_optimizer nvme_path at stage 3) is inside a checkpoint, at a name
// that `save_dir` (this run's, may be empty) or another save directory writes, or below one:
// the directory the run creates there would keep a checkpoint forever or block a save. The
// save directory itself may hold it (its swap files go into outcore_swap/).
bool check_swap_paths_outside_saves(const config::Config& cfg, const std::string& save_dir);
// False (with one error line naming the output's flag) when an output (path, flag; empty paths
// skipped) is inside a swap directory of `cfg` that acts (<nvme_path>/outcore_swap): the swap
// space removes files there as stale swap files of an earlier run.
bool check_outputs_outside_swap(const config::Config& cfg,
                                const std::vector<std::pair<std::string, const char*>>& outputs);
// False (with one error line naming `flag`) when `path` holds a file that a trace does not
// replace (trace::holds_trace_or_nothing): a user's file, another run's data or metrics.
bool check_replaces_only_a_trace(const std::string& path, const char* flag);

// A rank that fails ends the job: its swap files removed, then every rank ended through `comm`
// (the others may be waiting for it in a collective). Returns `code` at world size 1 (or
// without a Comm).
int fail_job(comm::Comm* comm, int code);

// Builds a Trainer from `cfg` (resolved), `model` and `options`, prints its summary on
// stdout, runs it with SIGINT/SIGTERM making it stop after the step in progress (a second
// signal kills the process), and prints the result on stdout. Progress goes to stderr.
// Returns 0 when every step ran, kExitInterrupted after a clean stop, 2 when the inputs are
// refused while setting up (config, model, data, a plan that does not fit: one "error:"
// line on stderr, naming `config_file` for a config key's error), 1 for a failure while
// training (I/O error, ...).
int run_training(const config::Config& cfg, const model::LlamaConfig& model,
                 train::TrainerOptions options, const std::string& config_file = "");

}  // namespace outcore::cli
