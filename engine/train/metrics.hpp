// Training metrics: a progress display for a terminal and a JSON-lines file, one record
// per optimizer step plus validation records.
//
// Both take plain structs filled by the trainer; I/O rates are a list of tiers so the
// trainer reports whatever tiers it has ("host", "nvme", ...).
// Threading: each object is used by one thread at a time.
#pragma once

#include <cstdint>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace outcore::train {

// Achieved I/O rate of one storage tier over the last step, in GB/s (1e9 bytes/s): the bytes of
// the transfers that completed during the step's wall time. The optimizer's work of one step
// (and its I/O) runs partly under the next step's forward, so one step's figure can hold part of
// the previous step's bytes; over steps without validations or saves between them the mean is
// the plan's traffic per step. What moves during a validation or a save (its own reads; and
// the previous step's optimizer work where that step did not wait for it, which Trainer::run()'s
// steps do) is counted in no step, so the step after one can show less, or nothing (parameters
// the validation gathered are not read again).
struct TierIo {
  std::string tier;  // "nvme", "host", ...
  double read_gb_per_s = 0;
  double write_gb_per_s = 0;
};

struct StepMetrics {
  int64_t step = 0;             // optimizer step, counted from 1
  int64_t total_steps = 0;      // 0 when unknown
  double loss = 0;              // mean training loss of the step (unscaled)
  double lr = 0;                // lr the step used
  std::optional<double> beta1;  // Adam's beta1 the step used, when the schedule sets it (OneCycle)
  double tokens_per_s = 0;      // training tokens of the step / its wall time
  int64_t tokens = 0;           // tokens the step computed (every rank, every micro-batch)
  // Of those, the targets its loss is a mean over: all of them without a loss mask.
  int64_t tokens_trained = 0;
  bool masked = false;      // the data has a loss mask (the line then shows tokens_trained)
  double gflops_per_s = 0;  // achieved model GFLOP/s (1e9 FLOP/s)
  uint64_t device_mem_peak_bytes = 0;
  double step_time_s = 0;
  double elapsed_s = 0;              // since training started
  std::optional<double> grad_norm;   // unscaled global norm before clipping
  std::optional<double> loss_scale;  // fp16 only
  bool skipped = false;              // overflow: no optimizer update was applied
  // outcore.step_in_backward: "committed", "redone" or "restored" (zero::StepResult::
  // in_backward); empty when the step started after the backward.
  std::string in_backward;
  std::vector<TierIo> io;
};

struct ValidationMetrics {
  int64_t step = 0;            // optimizer step after which validation ran
  double loss = 0;             // mean validation loss (over the targets not masked)
  int64_t tokens = 0;          // validation tokens evaluated
  int64_t tokens_trained = 0;  // of those, the targets the loss is a mean over
  bool masked = false;
  double time_s = 0;
};

// "step 12/1000 | loss 3.4521 | lr 1.000e-03 | 12.3k tok/s | 45.6 GFLOP/s | mem 1.23 GiB | ..."
// Optional parts (trained tokens with a loss mask, grad norm, loss scale, skipped, each tier)
// appear only when set.
std::string format_step_line(const StepMetrics& m);
// "val step 12 | loss 3.4521 | 65.5k tokens | 1.20 s" ("65.5k tokens, 30.1k trained" masked)
std::string format_validation_line(const ValidationMetrics& m);

// {"type":"step","step":12,"loss":...,"io":{"nvme":{"read_gb_per_s":..,"write_gb_per_s":..}}}
// Optional fields are absent when unset; a non-finite loss is written as null.
nlohmann::ordered_json to_json(const StepMetrics& m);
// {"type":"val","step":12,"loss":...,"tokens":...,"time_s":...}
nlohmann::ordered_json to_json(const ValidationMetrics& m);

// Progress on a terminal stream (stderr by default). In refresh mode each step overwrites
// the current line ("\r" + erase line); validation lines and messages are printed as whole
// lines above it. In lines mode (for logs and pipes) a step is a line of its own when
// `keep_every` (steps_per_print) is 0 or divides it, and for the first, last and skipped steps.
class ProgressDisplay {
 public:
  enum class Mode { kAuto, kLines, kRefresh };

  // kAuto picks kRefresh when `out` is a terminal, else kLines. `keep_every` > 0 also keeps
  // every keep_every-th step line on screen in refresh mode. `out` is not owned and must
  // outlive the display.
  explicit ProgressDisplay(std::FILE* out = stderr, Mode mode = Mode::kAuto,
                           int64_t keep_every = 0);
  ~ProgressDisplay();
  ProgressDisplay(const ProgressDisplay&) = delete;
  ProgressDisplay& operator=(const ProgressDisplay&) = delete;

  void step(const StepMetrics& m);
  void validation(const ValidationMetrics& m);
  // Any other line (a skipped step, a checkpoint saved), printed whole.
  void message(std::string_view line);
  // Ends a pending refreshed line with a newline; idempotent. Called by the destructor.
  void finish();

  Mode mode() const { return mode_; }

 private:
  void print_whole_line(std::string_view line);

  std::FILE* out_;
  Mode mode_;
  int64_t keep_every_;
  bool line_pending_ = false;  // a refreshed line without its newline is on screen
};

// What a resumed run knows of its checkpoint's run's metrics file (trainer_state.json).
struct MetricsResume {
  int64_t step = -1;  // the checkpoint's step (>= 0: the records of later steps are cut)
  // The file's length after the last record written before the checkpoint was saved, and that
  // record (0 and "": not known, a checkpoint written before they were saved): a file without
  // that record there is another run's (or was cut since), and is refused.
  uint64_t bytes = 0;
  std::string last_record;
  // Non-empty: checkpoints of the run after `step` (named here) still exist, and the records
  // of their steps are refused to be cut (this run is a branch of that one).
  std::string later_checkpoints;
};

// Appends one JSON object per line to a file; each line is written with one write() so a
// reader (tail -f, a plot script) never sees half a record, even after a crash.
class MetricsWriter {
 public:
  // Opens `path` for writing and locks it (flock: one run at a time): emptied, or appended to
  // when `append` (resuming a run). Throws IoError naming the path (open; the lock held by
  // another run), InvalidArgument for a file that is neither empty nor a metrics file (its first
  // line a JSON record with a "type"), appending or not: a user's file is never touched. The
  // file is emptied at the first record, not before; one this created is removed
  // again when destroyed without a record (while its name still names it).
  // `resumed_at` >= 0 (appending for a run resumed at that step): the records of steps after
  // it, which an earlier process wrote before it stopped, are cut from the file at the first
  // record (as TensorBoard's purge_step does), so that each step is recorded once; a warning
  // says how many. The cut is at the first record of a later step: everything after it goes.
  // `resume` (appending): the checks above.
  explicit MetricsWriter(const std::string& path, bool append = false, int64_t resumed_at = -1);
  MetricsWriter(const std::string& path, const MetricsResume& resume);
  // Closes, swallowing errors; call close() to see them.
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;

  void write(const StepMetrics& m) { write_json(to_json(m)); }
  void write(const ValidationMetrics& m) { write_json(to_json(m)); }
  // Any other record (a "start" record with the resolved config, say).
  // Throws IoError naming the path (disk full, ...); InvalidArgument after close().
  void write_json(const nlohmann::ordered_json& record);
  // Flushes to disk (fsync) and closes. Throws IoError naming the path; idempotent.
  void close();

  const std::string& path() const { return path_; }
  // The last record written (without its newline; "" before the first) and the file's length
  // just after it.
  const std::string& last_record() const { return last_record_; }
  uint64_t end() const { return end_; }

 private:
  MetricsWriter(const std::string& path, bool append, const MetricsResume& resume);
  void remove_if_unwritten() noexcept;

  std::string path_;
  bool empty_first_ = false;  // the file is emptied before the first record
  off_t cut_at_ = -1;         // >= 0: the file is cut there before the first record
  int64_t cut_records_ = 0;   // records after cut_at_
  int64_t resumed_at_ = -1;
  bool created_ = false;  // by this writer: removed again if it writes no record
  bool locked_ = false;   // this writer holds the file's flock
  bool wrote_ = false;    // a whole record was written
  int fd_ = -1;
  std::string last_record_;
  uint64_t end_ = 0;
};

}  // namespace outcore::train
