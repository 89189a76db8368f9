// engine/zero: ZeRO stages 0-3 with parameters and optimizer state on the device, in host
// memory or on NVMe, giving bit-identical training in every configuration.
//
// One ZeroEngine trains one LlamaModel on one Device for one data-parallel rank:
//
//   zero::ZeroEngine engine(cfg, model, device, comm, /*seed=*/42);
//   for (step t = 1..) {
//     for (k = 0 .. gas-1)
//       loss = engine.forward_backward(tokens_k, targets_k, scale / (gas * world), k == 0);
//     zero::StepResult r = engine.step(zero::step_params(cfg, lr, t, scale));
//     if (r.overflow) ... (the loss scaler backs off; nothing was updated)
//   }
//
// Data model (DESIGN.md): every unit's parameters are one flat slab of padded_numel elements;
// rank r owns elements [r*P, (r+1)*P) with P = padded_numel / world_size: its fp32 master
// weights, its Adam moments and its reduced fp32 gradients. Stage 0 owns the whole slab on
// every rank (plain data parallelism).
//
//   stage 0  full params, grads, master + moments on the device (offload keys ignored)
//   stage 1  optimizer state partitioned, in its tier (offload_optimizer: none/cpu/nvme);
//            full-slab fp32 gradient accumulators, of which the rank adds into its partition
//   stage 2  + gradient accumulators hold the rank's partition only
//   stage 3  + parameters partitioned in their tier (offload_param: none/cpu/nvme) and
//            gathered to the device per unit by the parameter coordinator
//
// Gradient reduction, at every stage with world size > 1 (decision 003): as each unit's
// backward of each micro-batch ends, its fp32 gradient slab goes through Comm::all_to_all,
// and the rank adds the world's contributions to its partition into its accumulator one rank
// after the other (never a reduce-scatter, whose order of sums depends on the world size).
// Stage 0 all-gathers the reduced partitions at step(). Every collective goes through
// comm::Comm, so a world size > 1 needs no change here. Arithmetic is the same in every
// configuration (same kernels, same ranges, same order), so losses and weights are
// bit-identical across stages and tiers, and world W with gas G matches world 1 with gas W x G
// (given the trainer's loss scale and data order).
//
// Threading: a ZeroEngine is driven by one thread at a time (REQUIRES external
// serialization). Internally it runs copy streams on the Device, I/O threads in aio and a
// thread pool for CPU Adam; every call below returns with that work finished or safely
// owned by the engine. Every decision that orders collectives (stage 3's fetches among them)
// is taken from bookkeeping, never from timing, so every rank issues the same collectives in
// the same order. Lifetimes: the config is copied; model, device and comm must outlive the
// engine.
//
// Errors: everything is an outcore::Error. A failed I/O (injected or real) while fetching
// parameters or swapping optimizer state surfaces as IoError naming the file, offset and
// errno from the call that needed it (forward_backward, evaluate or step); after such an
// error the engine's state is unspecified and it must be destroyed (its swap files are
// removed on destruction).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>

#include "engine/comm/comm.hpp"
#include "engine/config/config.hpp"
#include "engine/device/device.hpp"
#include "engine/model/model.hpp"
#include "engine/zero/plan.hpp"

namespace outcore::aio {
class IoBackend;
struct Options;
}  // namespace outcore::aio

namespace outcore::zero {

// Hyper-parameters of one optimizer step. Defaults are DeepSpeed's.
struct StepParams {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool adamw_mode = true;  // decoupled weight decay (config::OptimizerConfig::decoupled_...)
  bool bias_correction = true;
  uint64_t step = 1;        // Adam step number t, from 1, counting only applied steps
  double loss_scale = 1.0;  // the dynamic (or static) loss scale the gradients carry
  // Global L2 norm clipping threshold (config gradient_clipping); 0 = off.
  double gradient_clipping = 0.0;
  // Detect inf/NaN in the gradients and skip the update (fp16 always; bf16
  // check_grad_overflow). When false, non-finite gradients are applied as they are.
  bool check_overflow = true;
};

// StepParams from the resolved config's optimizer, gradient_clipping and fp16/bf16
// sections, with this step's lr, step number and loss scale.
StepParams step_params(const config::Config& cfg, double lr, uint64_t step, double loss_scale);

// DeepSpeed's unscale_and_clip_grads as the one multiplier applied to every gradient element.
// `grad_norm` is the global L2 norm of the unscaled, rank-averaged gradients; the gradients
// themselves still carry `loss_scale` and are summed (not averaged) over `world_size` ranks.
// ZeroEngine::step() always uses world_size 1: its gradients are averaged over the ranks
// already, because the loss scale passed to forward_backward includes 1 / (gas x world).
//   clip > 0: c = (grad_norm + 1e-6) / clip; returns 1 / (max(1, c) * loss_scale * world_size)
//   clip == 0: returns 1 / (loss_scale * world_size).
// A non-finite grad_norm does not clip (DeepSpeed's -1 sentinel). Throws InvalidArgument
// unless loss_scale is finite and > 0, clip is finite and >= 0, and world_size >= 1.
double unscale_and_clip_multiplier(double grad_norm, double loss_scale, double clip,
                                   int world_size = 1);

// The aio engine settings of a config's "aio" section (swap files, checkpoints).
aio::Options aio_options(const config::AioConfig& a);

// CPU Adam's threads for `share` (offload_optimizer.cpuadam_cores_perc, in (0, 1]) of
// `hardware_threads`: share x hardware_threads rounded to nearest, at least 1 and at most
// cpu_adam::Executor::kMaxThreads.
unsigned cpu_threads_for(double share, unsigned hardware_threads);
// cpu_threads_for the config's offload_optimizer.cpuadam_cores_perc on this machine.
unsigned cpu_threads_for(const config::Config& cfg);
// The threads of the host's data path (gradient accumulation and reduction, gradient norms,
// parameter and gradient swap checksums): every hardware thread (at most
// cpu_adam::Executor::kMaxThreads), in a pool of their own, so
// that this work never queues behind CPU Adam's chunks, takes the cores cpuadam_cores_perc
// leaves while Adam runs, and all of them when it does not (the step's norm).
unsigned data_path_threads();

struct StepResult {
  bool overflow = false;   // non-finite gradients: nothing updated, gradients cleared
  double grad_norm = 0.0;  // global L2 norm of the unscaled gradients (inf/NaN on overflow)
  // The multiplier applied to every gradient element: 1 / (loss_scale * clip), clip =
  // max(1, (grad_norm + 1e-6) / gradient_clipping) when clipping, else 1 (DeepSpeed's
  // unscale_and_clip_grads). 0 on overflow.
  double grad_scale = 0.0;
  // How the step related to the backward before it (outcore.step_in_backward): kNone, its
  // Adam started after step(); kCommitted, units stepped during the backward into the spare
  // state copy and the norm confirmed the multiplier they used; kRedone, clipping (or other
  // step parameters) differed, so every unit was stepped again from the state kept; kRestored,
  // an overflow skipped the step and the parameters written during the backward were rounded
  // again from the unchanged master weights.
  enum class InBackward { kNone, kCommitted, kRedone, kRestored };
  InBackward in_backward = InBackward::kNone;
};

// Cumulative bytes moved since construction, per path (for GB/s in a progress display).
struct TrafficStats {
  uint64_t nvme_read_bytes = 0;   // swap files read (parameters and optimizer state)
  uint64_t nvme_write_bytes = 0;  // swap files written
  uint64_t h2d_bytes = 0;         // host -> device copies
  uint64_t d2h_bytes = 0;         // device -> host copies
};

struct MemoryPeaks {
  uint64_t device_peak_bytes = 0;    // the device allocator's peak (charged bytes)
  uint64_t device_budget_bytes = 0;  // 0 = unlimited
  uint64_t pinned_peak_bytes = 0;    // the pinned pool's peak
  uint64_t pinned_budget_bytes = 0;  // the pinned pool's hard budget
};

// The three fp32 arrays of optimizer state each rank owns per unit.
enum class StateKind : uint8_t { kMaster, kExpAvg, kExpAvgSq };

// Options that do not come from the DeepSpeed config.
struct EngineOptions {
  // I/O backend of the swap files (nullptr: io_uring). Tests pass an
  // aio::FaultInjectingBackend to inject EIO / short I/O while prefetching or swapping.
  std::shared_ptr<aio::IoBackend> io_backend;
  // Check the plan against system_limits() at construction (device budget, pinned budget,
  // MemAvailable or what the memory cgroup leaves, free space under the swap paths). The device
  // budget is always enforced by the allocator itself.
  bool check_system_limits = true;
  // Threads of each of the engine's two CPU pools, CPU Adam's and the data path's; 0 = the
  // config's share of the hardware threads for Adam (offload_optimizer.cpuadam_cores_perc,
  // cpu_threads_for) and all of them for the data path (data_path_threads).
  unsigned cpu_threads = 0;
  // Where gradient accumulators go when the optimizer state is on NVMe (see plan.hpp).
  GradientPlacement gradients = GradientPlacement::kAuto;
  // Overlap the optimizer step with the next pass: step() computes the norm and the overflow
  // verdict, starts the per-unit Adam updates (in unit order) on a worker thread and returns;
  // the next forward (or evaluation) uses each unit as soon as its new parameters are
  // published, so NVMe swapping and Adam of later units run under the forward of earlier ones,
  // and stage 3 prefetches the next forward's first units while the step finishes. Results are
  // bit-identical to the sequential step (same kernels, same ranges). Every other call waits
  // for the step first. false: step() returns with every unit updated.
  bool overlap_step = true;
  // Checked between units while the swap files are initialised (minutes for a large model):
  // when set, the constructor stops with outcore::Interrupted (and removes its swap files).
  // Not owned; may be null.
  const std::atomic<bool>* stop_requested = nullptr;
  // Called on the constructing thread after each unit's initial state has been drawn and handed
  // to its tier (units done, units in all), for a display of the minutes a large model's
  // initialisation takes. Empty: nothing is called.
  std::function<void(size_t done, size_t units)> on_init_unit{};
  // A run that saves checkpoints: PlanOptions::save_piece_elems (the plan counts a save's host
  // buffers); nullopt: it does not save.
  std::optional<uint64_t> save_piece_elems = std::nullopt;
};

class ZeroEngine {
 public:
  // Builds the plan (make_plan with comm.world_size()), refuses what cannot fit
  // (OutOfMemory naming the tier, need and limit; IoError when a swap file cannot be
  // preallocated, naming the file and the bytes), creates and preallocates the swap files
  // under <nvme_path>/outcore_swap/rank<r>/, and initialises this rank's partitions with
  // model::init_params(layout, unit, seed, ...): fp32 master weights, zero moments, and the
  // low-precision parameters rounded from them.
  // REQUIRES: cfg resolved (config::require_resolved passes); model's param_dtype matches
  // the config (bf16 -> BF16, fp16 -> F16, else F32; ConfigError otherwise) and its layout
  // world size equals comm.world_size() (InvalidArgument otherwise). The device may be one
  // the host cannot read (a GPU): the model computes there and every transfer is a stream
  // copy; gradients are accumulated in host memory, except at one rank, where the units
  // Plan::device_grad_sums names are summed on the device over a step's micro-batches and sent
  // down once per step (decision 024). Optimizer state on such a device (offload_optimizer
  // none, a ratio < 1, stage 0) is stepped there by Adam on the device (device_adam.hpp,
  // decision 036), at one rank from gradients kept on the device where the budget allows
  // (decision 037).
  ZeroEngine(const config::Config& cfg, const model::LlamaModel& model, device::Device& device,
             comm::Comm& comm, uint64_t seed, EngineOptions options = {});
  // Waits for in-flight work and removes the swap files (errors logged, not thrown).
  ~ZeroEngine();
  ZeroEngine(const ZeroEngine&) = delete;
  ZeroEngine& operator=(const ZeroEngine&) = delete;

  const Plan& plan() const;
  // The machine's limits the plan was checked against, read before the engine allocated its
  // swap files and memory (reading them later would count the engine's own files as taken).
  // Empty when EngineOptions::check_system_limits was false.
  const PlanLimits& limits() const;
  const model::LlamaModel& model() const;
  // Threads of CPU Adam (cpu_threads_for), and of the host's data path: gradient accumulation
  // and norms, swap checksums (data_path_threads).
  unsigned cpu_threads() const;
  unsigned data_threads() const;

  // One micro-batch: forward over units 0..L, backward L+1..0 (parameters fetched per unit
  // in stage 3), gradients of loss_scale * mean cross-entropy reduced through Comm
  // (all_to_all, then an ordered sum; see above) into this rank's fp32 gradient partitions:
  // written on the first micro-batch of a step, added on the others. tokens/targets:
  // model.tokens() ids each, in [0, vocab) (InvalidArgument naming the position otherwise).
  // loss_scale: the trainer passes dynamic_scale / (gradient_accumulation_steps x world
  // size), so the summed gradients are the mean over every rank's micro-batches. Returns the
  // mean cross-entropy (unscaled). REQUIRES: first_micro_batch true for the first
  // micro-batch after construction or step() (InvalidArgument otherwise).
  float forward_backward(const int32_t* tokens, const int32_t* targets, float loss_scale,
                         bool first_micro_batch);

  // Forward only over the current parameters; returns the mean cross-entropy. Does not
  // touch the gradient accumulators.
  float evaluate(const int32_t* tokens, const int32_t* targets);

  // The optimizer step over the gradients accumulated since the last first_micro_batch:
  // global gradient L2 norm (sums of squares in double per 2048-element block of each rank's
  // reduced partitions, gathered from every rank with Comm::all_gather_bytes and added in slab
  // order: unit by unit, rank by rank, block by block; collective), overflow check, the
  // combined unscale+clip multiplier (no 1/world: see unscale_and_clip_multiplier), then Adam
  // per unit where that unit's state lives, and the new low-precision parameters written back
  // to their tier (at stages 1-2 all-gathered from every rank). With
  // EngineOptions::overlap_step the per-unit work finishes under the next pass. On overflow
  // (check_overflow) nothing is updated and the result says so.
  // REQUIRES: at least one forward_backward since construction or the last step()
  // (InvalidArgument otherwise).
  StepResult step(const StepParams& params);

  // The step the trainer will take after the next forward_backward (its last micro-batch),
  // with the parameters it will pass to step(). Where outcore.step_in_backward applies and
  // the multiplier without clipping is expected to hold (gradient_clipping 0, or the last
  // step's norm was below it), that pass starts each unit's NVMe Adam step as soon as the
  // unit's gradients are final, into a spare copy of its state; step() then commits, redoes or
  // restores (StepResult::in_backward), so results are bit-identical to the step after
  // backward. Otherwise it does nothing. Any call other than step() after that pass undoes
  // the tentative updates first.
  void expect_step(const StepParams& params);

  // Unit `unit`'s full fp32 master-weight slab (padded_numel elements, gathered from every
  // rank through Comm; collective). out.size() must equal the padded slab size.
  void get_master_weights(int unit, std::span<float> out);
  // Unit `unit`'s full low-precision parameter slab as the model computes with it
  // (padded_numel elements of the param dtype; collective).
  void get_params(int unit, std::span<std::byte> out);

  // This rank's partition of one optimizer-state array of `unit` (partition_numel
  // elements: the whole slab at stage 0), for checkpoints. read_state copies it out (not
  // collective); write_state replaces it, and writing kMaster also refreshes the unit's
  // low-precision parameters from it, which at stages 1 and 2 gathers them through Comm
  // (collective: every rank calls it for the same unit and kind). InvalidArgument for a
  // wrong size or unit.
  size_t partition_numel(int unit) const;
  void read_state(int unit, StateKind kind, std::span<float> out);
  void write_state(int unit, StateKind kind, std::span<const float> in);

  // Checkpoint access to everything this rank owns of a unit, streamed in one pass each.
  // partition_offset(unit): the first slab element this rank owns (its range is
  // [partition_offset, partition_offset + partition_numel)).
  size_t partition_offset(int unit) const;
  // Calls fn(first, n, master, exp_avg, exp_avg_sq) for consecutive ranges [first, first + n)
  // of this rank's partition of `unit`, in order, covering it; the pointers are valid during
  // the call only (the arrays themselves in memory; one optimizer sub-group of a pinned ring
  // buffer when the state is on NVMe, so host memory does not grow by the unit). Not
  // collective. Throws what the tier throws and what fn throws.
  using StateVisitor = std::function<void(size_t first, size_t n, const float* master,
                                          const float* exp_avg, const float* exp_avg_sq)>;
  void visit_unit_state(int unit, const StateVisitor& fn);
  // The reverse: fn writes every element of each range (moments start at zero), then the
  // unit's low-precision parameters are refreshed from the master weights, rounded as the
  // optimizer's copy-out rounds, which at stages 1 and 2 gathers them through Comm
  // (collective: every rank calls it for the same unit). After a throw the engine's state is
  // unspecified (destroy it).
  using StateFiller =
      std::function<void(size_t first, size_t n, float* master, float* exp_avg, float* exp_avg_sq)>;
  void fill_unit_state(int unit, const StateFiller& fn);
  // Copies of the above for whole partitions (each partition_numel elements).
  void read_unit_state(int unit, std::span<float> master, std::span<float> exp_avg,
                       std::span<float> exp_avg_sq);
  void write_unit_state(int unit, std::span<const float> master, std::span<const float> exp_avg,
                        std::span<const float> exp_avg_sq);
  // Calls fn with this rank's partition of the low-precision parameters of `unit`
  // (partition_numel elements of the param dtype, as the model computes with them), valid
  // during the call (read from NVMe into a staging buffer when they live there). Not
  // collective.
  void visit_param_partition(int unit, const std::function<void(std::span<const std::byte>)>& fn);
  void read_param_partition(int unit, std::span<std::byte> out);
  DType param_dtype() const;

  // Waits until the last step's updates are all published (with overlap_step they otherwise
  // finish under the next pass); rethrows the step's error. Counters read after it include
  // the whole step.
  void wait_step();

  TrafficStats traffic() const;
  MemoryPeaks memory() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace outcore::zero
