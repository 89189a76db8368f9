// Trainer: the training loop of one data-parallel rank, built from a resolved DeepSpeed
// config, a Llama config and token files.
//
//   train::TrainerOptions o;
//   o.train_data = "tokens.bin";
//   o.steps = 1000;
//   train::Trainer trainer(cfg, model_cfg, o);   // validates everything, allocates, plans
//   train::TrainResult r = trainer.run();        // steps, validation, metrics, progress
//
// Per optimizer step t (1-based, counting skipped steps, as DeepSpeed's global_steps):
//   for k in 0..gas-1: loss_k = engine.forward_backward(batch_k, scale / gas, k == 0)
//   r = engine.step(step_params(cfg, schedule.lr(), adam_step, scale))   (+ OneCycle betas)
//   loss scaler.update(r.overflow); if the step was applied: schedule.step(), adam_step++
// A skipped step (fp16 overflow) applies nothing, leaves the lr schedule and the Adam step
// count where they were, and is logged with the scaler's message. Validation runs every
// eval_every steps and after the last step.
//
// The Trainer owns its device (TrainerOptions::device: the simulated CpuDevice or a GPU, under
// the budget outcore.device_memory_mb), the LlamaModel (computing through that device's
// backend), the
// ZeroEngine (whose swap files live as long as the Trainer), the data loaders, the lr
// schedule and the loss scaler. Its Comm (TrainerOptions::comm) is the caller's; without one
// it is a world of one (LocalComm).
//
// Data parallelism (world W > 1, every rank a process running the same Trainer): rank r's
// micro-batch k of step t is global micro-batch t*G*W + k*W + r of the data order (the
// DataLoader's rank slicing), its loss is scaled by scale / (G*W), and the engine adds the
// ranks' gradients rank by rank in that order. Losses and validation losses are gathered and
// summed in the same global order. So W ranks with gas G train bit-identically to one rank
// with gas W*G over the same samples: same losses, grad norms and weights. With a loss mask
// the scale is scale x B*T / N instead, N the step's targets trained on by every rank (each
// rank counts them from the shared files): the loss is the mean over them, as with Hugging
// Face's -100 labels (decision 023). A validation pass is the set's first eval_batches
// micro-batches, rank r taking r, r + W, ...
//
// Construction checks the data, the configs and a checkpoint to resume from (a model config
// that differs from the checkpoint's in any key is refused) before it builds the engine, last,
// so a refusal leaves no swap file; a save directory without room for the checkpoints the run
// holds at once is refused right after the engine is built.
//
// Threading: one thread drives a Trainer. The only cross-thread input is
// TrainerOptions::stop_requested, which a signal handler or another thread may set at any
// time: the step in progress finishes, then run() returns normally.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "common/lock_file.hpp"
#include "common/trace.hpp"
#include "engine/ckpt/ckpt.hpp"
#include "engine/comm/comm.hpp"
#include "engine/config/config.hpp"
#include "engine/model/model.hpp"
#include "engine/train/config_adapters.hpp"
#include "engine/train/data_loader.hpp"
#include "engine/train/loss_scaler.hpp"
#include "engine/train/lr_schedule.hpp"
#include "engine/train/metrics.hpp"
#include "engine/train/token_file.hpp"
#include "engine/zero/zero.hpp"

namespace outcore::train {

struct TrainerOptions {
  std::string train_data;  // token file (see token_file.hpp); required
  // Validation token file; empty = none, unless val_fraction holds out the tail of
  // train_data.
  std::string val_data;
  // With no val_data: the fraction of train_data's tail held out for validation (and not
  // trained on), in [0, 1). 0 = no validation set.
  double val_fraction = 0.0;
  TokenFormat token_format = TokenFormat::kAuto;
  // Loss masks (token_file.hpp) of train_data and val_data; empty = none. A held-out tail
  // (val_fraction) uses train_mask. Masked targets count in neither the loss nor the
  // gradients; the loss is the mean over the step's targets that are trained on.
  std::string train_mask;
  std::string val_mask;

  int64_t steps = 0;     // optimizer steps to run (skipped ones included); >= 1
  uint64_t seed = 1234;  // model initialisation and data order
  // Tokens per sequence; 0 = min(max_position_embeddings, 1024).
  int64_t seq_len = 0;
  // Validate every eval_every steps (0: only after the last step) when there is a
  // validation set; eval_every > 0 without one is an InvalidArgument.
  int64_t eval_every = 0;
  // Micro-batches per validation, taken from the start of the validation set every time
  // (so validations are comparable); capped at the set's micro-batches. >= 1.
  int64_t eval_batches = 8;
  // Recompute each unit's forward in backward. Unset: on when the config's
  // activation_checkpointing section asks for anything (cpu_checkpointing,
  // partition_activations or number_checkpoints).
  std::optional<bool> activation_checkpointing;
  // The keys of the run's own DeepSpeed config that were "auto" or left out (filled by flags or
  // defaults), saved with each checkpoint: a resume on the checkpoint's resolved config lets
  // this run's flags fill them again (outcore train).
  std::vector<std::string> config_auto_keys;

  // JSON lines per step and per validation; empty = cfg.outcore.metrics_file (which may
  // be empty too: no file).
  std::string metrics_file;
  // Chrome trace-event JSON of run() (common/trace.hpp), written when run() returns (also after
  // a stop request, and when it throws: the trace up to the failure, a warning naming the file);
  // empty = no trace. Rank 0 only: tracing is process-wide and ranks are
  // processes. The trace is recorded from run()'s start, so its I/O bytes are the engine's
  // traffic during run(). The file is locked from construction (OutputLock: PathBusy while
  // another run holds it).
  std::string trace_file;
  // Progress display stream (not owned); nullptr = no display. Refreshed in place on a
  // terminal; otherwise one line per step, or per steps_per_print steps when the config
  // sets it (skipped steps and validations are always printed).
  std::FILE* progress_out = stderr;
  ProgressDisplay::Mode progress_mode = ProgressDisplay::Mode::kAuto;
  // Once the engine's initialisation (drawing every unit's weights and writing its state) has
  // run this many seconds, progress_out gets a line per unit, at most one a second, and the
  // last one.
  double init_progress_after_s = 2.0;

  // Set (by a SIGINT handler, another thread, a callback) to stop after the step in
  // progress. Not owned; may be null.
  const std::atomic<bool>* stop_requested = nullptr;
  // Called after every optimizer step with its metrics (on the training thread).
  std::function<void(const StepMetrics&)> on_step;

  zero::EngineOptions engine;  // I/O backend (fault injection), CPU threads, limit checks

  // Data-parallel ranks (not owned; must outlive the Trainer). `comm` carries the engine's
  // collectives (its traffic is what the plan predicts); `control_comm`, a second Comm over
  // the same ranks, the trainer's own: losses, stop and save decisions. Both null: a world of
  // one. One set without the other, or different worlds: InvalidArgument.
  comm::Comm* comm = nullptr;
  comm::Comm* control_comm = nullptr;

  // Where the model computes: the simulated device (Cpu; `discrete` simulates a GPU whose
  // memory the host cannot read, every transfer a stream copy) or GPU `gpu` (Cuda;
  // InvalidArgument when the build or the machine has none).
  device::DeviceKind device = device::DeviceKind::Cpu;
  int gpu = 0;
  bool discrete = false;

  // Checkpoints (engine/ckpt). With save_dir set, run() saves every save_every steps (0: only
  // at the end), after the last step, and after a stop; keep > 0 keeps the newest `keep`.
  // save_dir may hold the user's other files (never touched); checkpoints already in it are
  // this run's when it resumes from one of them, refused otherwise (InvalidArgument naming
  // them) unless start_over, which removes them once this run's first checkpoint is saved.
  std::string save_dir;
  int64_t save_every = 0;
  int keep = 0;
  bool start_over = false;
  // Resume from a checkpoint directory, or a save directory whose `latest` names one: every
  // file is verified (sizes, CRCs) before anything is built, then the engine's state, the step
  // count, the lr schedule, the loss scaler and the data position are restored. The config may
  // place the state differently (stage, offload, budgets) and the world size may differ (the
  // flat slabs are re-sliced; the data position must fill whole micro-batches of the new
  // world); the model must match (ConfigError naming the first key of its config.json that
  // differs, or the unit whose shape does), and so must the micro-batch and sequence length
  // (InvalidArgument naming both values); `steps` may not be below the checkpoint's step
  // (InvalidArgument). With micro x gas x world unchanged the resumed run is bit-identical to
  // an uninterrupted one.
  std::string resume_from;
  // Start from a Hugging Face directory's weights (config.json + safetensors) instead of a
  // random initialisation. Exclusive with resume_from.
  std::string init_from;
  // Checkpoint I/O: test hooks and a fault-injecting backend; aio settings come from the
  // config's "aio" section.
  ckpt::WriterOptions checkpoint_io;
};

// What run() did.
struct TrainResult {
  int64_t steps = 0;          // optimizer steps run (applied + skipped)
  int64_t skipped_steps = 0;  // steps skipped for overflow
  // outcore.step_in_backward: steps whose Adam started during the backward and stood, was
  // redone after it (clipping), or was undone (overflow).
  int64_t in_backward_committed = 0, in_backward_redone = 0, in_backward_restored = 0;
  bool stopped = false;          // stop_requested ended the run before `steps`
  std::vector<double> losses;    // mean training loss of each step (0 for a step of no target)
  std::vector<int64_t> targets;  // the targets each step's loss is a mean over
  std::optional<double> final_val_loss;
  uint64_t tokens = 0;  // training tokens processed
  double wall_s = 0;    // training time (validation excluded)
  double tokens_per_s = 0;
  double gflops_per_s = 0;  // achieved model FLOP/s (train_flops_per_token), in 1e9
  zero::MemoryPeaks memory;
  zero::TrafficStats traffic;                 // cumulative since the engine was built
  std::vector<ckpt::SaveResult> checkpoints;  // saved by this run, oldest first
  // With TrainerOptions::trace_file: the spans written and how much I/O ran under compute
  // (forward/backward) and under compute or the optimizer.
  struct Trace {
    std::string path;
    size_t events = 0;
    trace::IoOverlap under_compute;
    trace::IoOverlap under_compute_or_optimizer;
  };
  std::optional<Trace> trace;
  // Why the metrics file stopped receiving records (a full disk, ...), empty when it did not:
  // the run trains and saves on, and the caller reports the failure once it ends.
  std::string metrics_error;
  // Why the trace file could not be written (the previous one, if any, is kept), empty when it
  // was or none was asked for.
  std::string trace_error;
};

class Trainer {
 public:
  // Checks and builds everything; nothing is trained yet.
  // Throws ConfigError (config not resolved per config::require_resolved, a scheduler or
  // fp16 value the schedule/scaler refuses, model config invalid, OneCycle's momentum decay
  // taking beta1 to 1 within `steps`), InvalidArgument (bad options: steps < 1, seq_len >
  // max_position_embeddings, eval_every without a validation set, a split too short for one
  // micro-batch, a loss mask with no trained target in its split's sequences or in a
  // validation pass), CorruptData (a bad token file
  // header, a token id outside the vocabulary), IoError (a file that cannot be read, swap
  // files that cannot be created), OutOfMemory (the placement plan does not fit a tier).
  Trainer(const config::Config& cfg, const model::LlamaConfig& model_config,
          TrainerOptions options);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // Runs the remaining optimizer steps (up to options.steps in all), validating, writing
  // metrics and progress, until done or stop_requested. Returns normally after a stop.
  // Throws what the engine throws (IoError while swapping, ...), LossScaleAtMinimum when
  // the fp16 scale cannot go lower, IoError when the metrics file cannot be created or its
  // first record written; a later failed write ends the metrics only
  // (TrainResult::metrics_error) and the run goes on.
  TrainResult run();

  // One optimizer step (gas micro-batches and the update); returns its metrics. Does not
  // print or write metrics. REQUIRES steps_done() < options.steps is not enforced: callers
  // may step past it. The update may finish under the next step's forward; with
  // `wait_for_update` the step waits for it, and its time and I/O include it (run() passes true
  // where a validation, a save or the run's end comes next: a save and the end wait for it
  // anyway, a validation's forward would hide it, but its time and bytes would then be no
  // step's; decision 001). An update that fails then fails this call.
  StepMetrics train_step(bool wait_for_update = false);
  // Mean loss over the validation micro-batches. REQUIRES has_validation().
  ValidationMetrics validate();

  // Saves a checkpoint of the current state into options.save_dir now (tag global_step<N>).
  // REQUIRES save_dir set (InvalidArgument otherwise). Throws IoError (disk full: the previous
  // checkpoint and the training state are untouched).
  ckpt::SaveResult save_checkpoint();
  // The state a checkpoint's trainer_state.json holds, and its restoration.
  nlohmann::ordered_json state_json() const;

  bool has_validation() const;
  int64_t steps_done() const { return steps_done_; }
  // Adam steps applied (the step number the next applied update uses is this + 1).
  uint64_t adam_steps() const { return adam_steps_; }
  // Training tokens per optimizer step: micro_batch x seq_len x gas x world.
  int64_t tokens_per_step() const;

  // Multi-line description of the run: the resolved config's main choices, the model, the
  // data, and the placement plan with the machine's limits.
  std::string summary() const;

  const config::Config& config() const { return cfg_; }
  const model::LlamaModel& model() const { return *model_; }
  // The device the model computes on (TrainerOptions::device).
  const device::Device& device() const;
  zero::ZeroEngine& engine() { return *engine_; }
  LrSchedule& schedule() { return *schedule_; }
  // Mutable so a checkpoint (or a test) can restore its state.
  LossScaler& loss_scaler() { return scaler_; }
  DataLoader& train_loader() { return *train_loader_; }

 private:
  struct Devices;  // the device + the Comms, built before the engine

  void open_data();
  // run() within its trace: the steps, validations, saves and the run's figures.
  TrainResult run_steps(bool tracing);
  // How many micro-batches a validation pass evaluates (of every rank in turn): --eval-batches,
  // at most the validation set's.
  int64_t eval_micro_batches() const;
  int world_size() const;
  int rank() const;
  comm::Comm& comm() const;
  comm::Comm& control() const;
  // Whether any rank was asked to stop (collective at world > 1).
  bool stop_requested() const;
  // Sum of per-rank values gathered in global micro-batch order: values[k] of rank r is
  // global item k*W + r; only the first `count` global items are added (in double).
  double sum_in_global_order(std::span<const float> values, int64_t count) const;
  ckpt::SaveGroup save_group_;  // the ranks saving together (world > 1)
  // The metrics file's first record: {"type":"start", config, model, run facts}.
  nlohmann::ordered_json start_record() const;

  config::Config cfg_;
  TrainerOptions opts_;
  int64_t gas_ = 1;
  // The devices outlive the model (its compute backend holds memory and a stream on them) and
  // the engine.
  std::unique_ptr<Devices> devices_;
  std::unique_ptr<model::LlamaModel> model_;
  std::unique_ptr<zero::ZeroEngine> engine_;
  std::unique_ptr<DataLoader> train_loader_, val_loader_;
  std::unique_ptr<LrSchedule> schedule_;
  LossScaler scaler_;
  std::vector<int32_t> inputs_, targets_;
  int64_t steps_done_ = 0;
  uint64_t adam_steps_ = 0;
  // The traffic when the last step, validation or save ended: a step's I/O rates are the bytes
  // moved since, over its wall time.
  zero::TrafficStats last_traffic_;
  std::string last_message_;  // the loss scaler's message for the last skipped step
  // Steps skipped for non-finite gradients since the last step that updated the weights; with
  // no dynamic loss scale, kMaxSkippedInARow of them end the run.
  int64_t skipped_in_a_row_ = 0;
  static constexpr int64_t kMaxSkippedInARow = 10;
  std::unique_ptr<ckpt::SaveDir> save_dir_;
  // Rank 0's metrics file, opened (and locked) at construction; run() writes and closes it.
  std::optional<MetricsWriter> metrics_writer_;
  // Rank 0's trace file, locked from construction to the end: one run at a time writes it.
  std::unique_ptr<OutputLock> trace_lock_;
  int64_t last_saved_step_ = -1;
  nlohmann::json resume_state_;  // trainer_state.json of the checkpoint resumed from
  std::string resumed_from_;
  // The step whose validation was recorded last (-1: none), saved with each checkpoint: a resume
  // on the same validation set does not record it twice.
  int64_t validated_step_ = -1;

  // What the save directory's existing checkpoints are to this run (TrainerOptions::save_dir).
  ckpt::ExistingCheckpoints existing_checkpoints() const;
  // The name of the checkpoint resumed from when it lies in the save directory; empty otherwise.
  std::string resumed_tag_in_save_dir() const;
  // The checkpoints a run from step `done` to opts_.steps saves (every save_every steps and at
  // the end; at least one).
  int64_t saves_of_run(int64_t done) const;
  void open_resume_checkpoint(std::optional<ckpt::Checkpoint>& ck,
                              const model::LlamaConfig& model_config, int64_t seq_len);
  void restore(const ckpt::Checkpoint& ck);
};

// The model's parameter dtype under the config: BF16 with bf16, F16 with fp16, else F32.
DType param_dtype(const config::Config& cfg);

// The default sequence length for a model: min(max_position_embeddings, 1024).
int64_t default_seq_len(const model::LlamaConfig& model_config);

}  // namespace outcore::train
