// engine/zero placement planner: before training, where every byte of training state lives
// and how many bytes move per optimizer step, for one config and one model.
//
// The plan is the engine's own budget: ZeroEngine sizes its device buffers, its pinned pool
// and its swap files from it, so the peaks it reports are the peaks the engine reaches
// (device bytes are charged bytes, see device::charged_bytes). `outcore estimate` prints it;
// `outcore train` (through ZeroEngine) refuses a plan that does not fit.
//
// The tiers and the placement types (Tier, Placement, GradientPlacement) are in placement.hpp.
// Every per-unit decision (which unit lives in which tier, how large its slabs are) is the
// geometry's (geometry.hpp); the plan only counts bytes from it. Stage 3's fetches per step
// replay the coordinator's residency policy (residency.hpp) over the step's passes, so the
// plan's traffic is the engine's.
//
// Threading: every function here is pure (system_limits reads /proc and statvfs) and
// thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "engine/config/config.hpp"
#include "engine/model/model.hpp"
#include "engine/zero/placement.hpp"

namespace outcore::zero {

// Bytes per tier.
struct TierBytes {
  uint64_t device = 0;
  uint64_t pinned = 0;
  uint64_t host = 0;
  uint64_t nvme = 0;
  uint64_t& operator[](Tier t);
  uint64_t operator[](Tier t) const;
};

// Bytes moved per path: NVMe reads and writes, host-to-device and device-to-host copies.
struct TrafficBytes {
  uint64_t nvme_read = 0;
  uint64_t nvme_write = 0;
  uint64_t h2d = 0;
  uint64_t d2h = 0;
  // Bytes this rank sends to the other ranks (comm::CommTraffic's volumes; 0 at world 1):
  // each micro-batch's gradients (all_to_all of the fp32 slabs), stage 3's parameter gathers,
  // stages 1-2's gather of the updated parameters, stage 0's gather of the reduced gradients,
  // and the gradient norm's partial sums.
  uint64_t comm = 0;
};

// One line of the plan: `bytes` of `what` held in `tier` at the tier's peak.
struct PlanItem {
  Tier tier = Tier::kDevice;
  std::string what;  // "fp32 master + Adam moments (12 B/param, partition)"
  uint64_t bytes = 0;
  // The JSON path of the config key whose value sizes this item
  // ("zero_optimization.offload_param.buffer_count"; for the activations the batch key and the
  // flag of the sequence length), or empty when the model does.
  std::string key;
};

struct Plan {
  Placement placement;
  int world_size = 1;
  int64_t micro_batches_per_step = 1;  // gradient_accumulation_steps
  int64_t tokens_per_micro_batch = 0;  // B*T
  uint64_t num_parameters = 0;         // model parameters (tied weight once)
  uint64_t padded_elems = 0;           // sum of padded slab sizes (every unit)
  // One checkpoint's data files, every rank's (outcore train --save-dir): fp32 master weights,
  // Adam moments and the low-precision parameters of every padded element.
  uint64_t checkpoint_bytes = 0;
  // fp32 optimizer state: own elements of every unit, and of those the elements homed in
  // placement.optimizer when it is host memory or NVMe (all of them, less the units
  // offload_optimizer.ratio keeps on the device; 0 when the optimizer is on the device).
  uint64_t optimizer_elems = 0;
  uint64_t offloaded_optimizer_elems = 0;
  double optimizer_ratio = 1.0;  // offload_optimizer.ratio
  // PlanOptions::device_host_accessible: false for a GPU, where the state on the device is
  // stepped by Adam on the device and CPU Adam steps the offloaded elements only.
  bool device_host_accessible = true;
  // PlanOptions::device_in_host_memory: the simulated device, whose memory host memory holds
  // (host_need_bytes counts the device's peak).
  bool device_in_host_memory = true;
  // outcore.step_in_backward applies (Geometry::step_in_backward): the NVMe optimizer steps run
  // during the backward of a step's last micro-batch instead of under the next step's forward.
  bool step_in_backward = false;

  TierBytes peak;               // bytes each tier holds at its peak
  std::vector<PlanItem> items;  // what makes up each tier's peak, in tier order
  TrafficBytes per_step;        // bytes moved per optimizer step (all micro-batches)

  // Budgets the engine runs under (all in bytes; device ones are charged bytes).
  uint64_t device_live_param_bytes = 0;  // stage 3: gathered parameter slabs on the device
  uint64_t device_grad_bytes = 0;        // fp32 gradient slabs in flight on the device
  // Per unit: its gradients are summed on the device over the step's micro-batches
  // (detail::device_grad_sum_applies: a device the host cannot read, one rank, accumulators off
  // the device, and gradient_accumulation_steps > 1 or Adam on the device for the unit). Those
  // Adam steps on the device stay there for it (detail::grads_stay_on_device, decision 037);
  // the others are copied back once per step (decision 024). The units whose sums fit in the
  // device limit left after the rest of the device tier (stage 3's gathered parameters
  // included), those stepped on the device first. Every entry false otherwise.
  std::vector<bool> device_grad_sums;
  uint64_t device_grad_sum_bytes = 0;    // their fp32 sums (charged bytes)
  uint64_t device_grad_norm_blocks = 0;  // the norm's block sums of those that stay (doubles)
  uint64_t pinned_pool_bytes = 0;        // size of the pinned pool the engine creates
  std::string param_nvme_path;           // swap directory for parameters (nvme_param_units > 0)
  std::string optimizer_nvme_path;       // swap directory for optimizer state, or empty
  uint64_t param_nvme_bytes = 0;         // of peak.nvme, parameter files
  uint64_t optimizer_nvme_bytes = 0;     // of peak.nvme, optimizer-state (and gradient) files
  // Of peak.nvme, at most the blocks the swap trees' directories and lock files take besides
  // (swap::SwapSpace::tree_bytes_needed), under each path.
  uint64_t param_nvme_tree_bytes = 0, optimizer_nvme_tree_bytes = 0;
  // When zero_optimization.sub_group_size pads the optimizer's swap files (and each step's I/O)
  // to more than 1.1 times the state: a sentence naming the key and both sizes; else empty.
  std::string sub_group_padding;
};

// The host memory a run takes besides its buffers, which the plan counts as an estimate (the
// one host item that is not exact): threads' stacks, BLAS, oneDNN and oneTBB buffers, the
// allocator's arenas, the data loader and the metrics. 48 MiB and 4 MiB per pool thread
// (docs/benchmarks.md, "The plan's host memory against the measured peak").
inline uint64_t runtime_host_bytes(unsigned pool_threads) {
  return (uint64_t{48} << 20) + uint64_t{pool_threads} * (uint64_t{4} << 20);
}

// What the planner needs besides the config and the model.
struct PlanOptions {
  int world_size = 1;
  // Device bytes available to the engine; 0 = outcore.device_memory_mb (0 there: unlimited).
  // ZeroEngine passes its Device's budget minus what is already allocated on it.
  uint64_t device_limit_bytes = 0;
  GradientPlacement gradients = GradientPlacement::kAuto;
  // False for a GPU (the host cannot read its memory): the plan adds the pinned buffer that
  // gradient slabs are copied back through. ZeroEngine passes Device::host_accessible().
  bool device_host_accessible = true;
  // True for the simulated device (DeviceKind::Cpu, host-accessible or discrete): its memory is
  // host memory, which then holds the device's peak too. False for a GPU.
  bool device_in_host_memory = true;
  // Device bytes the gradient sums (Plan::device_grad_sums, which take whatever the limit
  // leaves) leave free for what lives outside the plan: device_reserve_bytes() where the GPU's
  // free memory, not a budget, is the limit.
  uint64_t device_reserve_bytes = 0;
  // Device bytes the model's compute backend keeps (device::backend_workspace of the model's
  // workspace_shape on this device: cuBLASLt's workspace, attention's, staged ids, constant
  // tables on a GPU; 0 on the simulated device). ZeroEngine passes it and, since the backend
  // holds part of it before the engine starts, counts what it holds as not yet allocated.
  uint64_t compute_workspace_bytes = 0;
  // The machine planned for when it is not this one (outcore estimate for a machine to rent):
  // > 0, its host memory instead of MemAvailable, and the free bytes of its swap drive (one
  // filesystem) instead of those under the config's nvme_path. apply_machine() sets them.
  uint64_t host_memory_bytes = 0;
  uint64_t nvme_free_bytes = 0;
  // A run that saves checkpoints, whose writer cuts segments of this many elements (0: the
  // writer's default, ckpt::WriterOptions::piece_elems): the plan counts a save's host buffers.
  // nullopt: a run that does not save.
  std::optional<uint64_t> save_piece_elems = std::nullopt;
};

struct PlanLimits;
// Replaces `limits`' host and swap-space figures by po's machine where given (naming the flags
// --host-memory-gb and --nvme-free-gb that set them).
void apply_machine(PlanLimits& limits, const PlanOptions& po);

// The device bytes the gradient sums leave free when `hardware_free` (Device::
// free_memory_bytes(): a GPU's free memory; 0 for the simulated device) caps the limit rather
// than `budget_left` (the budget not yet allocated; 0: no budget): a sixteenth of it, at least
// 1 GiB, for the CUDA context's growth, cuBLASLt's and cuDNN's own allocations and the
// allocator's slack, none of which the plan counts. 0 when a budget is the tighter limit (the
// budget is the user's word) or on the simulated device.
uint64_t device_reserve_bytes(uint64_t budget_left, uint64_t hardware_free);

// The plan for `cfg` (resolved: batch keys and zero bucket sizes set) and `model` (whose
// ModelOptions give the micro-batch shape, param dtype and activation checkpointing).
// Throws ConfigError naming the JSON path when the combination is impossible (fp16/bf16
// enabled but the model's param dtype differs; offload_param.buffer_size smaller than the
// largest parameter partition in swap files, which each fetch buffer must hold, as in
// DeepSpeed; offload_param below stage 3 is ignored with a warning instead, as DeepSpeed
// does), InvalidArgument for a world_size outside 1..config::kMaxWorldSize.
Plan make_plan(const config::Config& cfg, const model::LlamaModel& model,
               const PlanOptions& options = {});

// What the machine offers each tier; 0 (or unset) = no limit.
struct PlanLimits {
  uint64_t device = 0;  // outcore.device_memory_mb * 2^20 (0 = unlimited)
  // What sets `device`, as refusals and the table name it: the config key, or a GPU's free
  // memory where that is the smaller.
  std::string device_by = "outcore.device_memory_mb";
  uint64_t pinned = 0;  // outcore.pinned_memory_mb * 2^20 (0 = sized by the plan)
  // MemAvailable from /proc/meminfo, or what the memory cgroup leaves where less
  // (detail::host_memory_available).
  uint64_t host = 0;
  std::string host_by = "MemAvailable";  // what sets `host`, as the table and refusals name it
  // statvfs free bytes (f_bavail * f_frsize) of the parameter / optimizer swap directories
  // (the nearest existing ancestor when the directory does not exist yet); unset = not
  // checked (no such directory in the plan, or not queried).
  std::optional<uint64_t> param_nvme;
  std::optional<uint64_t> optimizer_nvme;
  bool nvme_same_filesystem = false;  // both directories on one filesystem (needs add up)
  // What sets the free bytes when not this machine's filesystems (a flag), else empty.
  std::string nvme_by;
};

// Reads the limits for `plan` under `cfg` from the config and the system. Throws IoError
// naming the path when a swap directory's filesystem cannot be queried.
PlanLimits system_limits(const config::Config& cfg, const Plan& plan);

// Throws OutOfMemory when a tier's peak exceeds its limit, naming the tier, the bytes
// needed, the limit and the config key or path that sets it, e.g.
//   "device: the plan needs 1.20 GiB (1288490188 bytes) at its peak but
//    outcore.device_memory_mb allows 1.00 GiB (1073741824 bytes)"
// and for NVMe "nvme: swap files under /mnt/nvme need N bytes, the filesystem has M free".
// Host needs (host_need_bytes) count the pinned pool (pinned_pool_bytes, allocated whole at
// start) + host bytes (+ the simulated device's) against PlanLimits::host: MemAvailable, or
// what the memory cgroup leaves where less. When the largest part of a pinned or host refusal is
// sized by a config key (PlanItem::key, or outcore.pinned_memory_mb for a pool larger than the plan
// needs), the message ends by naming that key and its share.
void check_fits(const Plan& plan, const PlanLimits& limits);

// Bytes of host memory the plan takes: the pinned pool (at least the pinned peak) plus the
// host tier's peak, plus the device's peak where the device is simulated (its memory is host
// memory). What check_fits compares with PlanLimits::host. The process's own code, libraries
// and thread stacks (about 100-200 MiB) and a save's staging buffers (checkpoint_host_bytes)
// come on top.
uint64_t host_need_bytes(const Plan& plan);

// The plan as a table for a terminal: one row per item (tier, what, bytes in human units),
// tier totals, and the per-step traffic. When `limits` is given, totals show the limit and
// whether it fits.
std::string format_plan(const Plan& plan, const PlanLimits* limits = nullptr);

// "1.50 GiB", "512.0 MiB", "12 B".
std::string format_bytes(uint64_t bytes);

// What `outcore estimate` (and the Python outcore.estimate) plans for besides the two files.
// Values outside the ranges below are refused by estimate_model_options (resolve_auto).
struct EstimateInputs {
  int64_t world_size = 1;  // 1..config::kMaxWorldSize
  // 0: the config's train_micro_batch_size_per_gpu, else 1; at most config::kMaxMicroBatch.
  // Replaces the config's where the config sets a micro-batch or gradient_accumulation_steps
  // (the accumulation, written or following from train_batch_size, kept; train_batch_size
  // following: micro-batch x accumulation x world size, with a warning where the config wrote
  // another); where it sets neither, or "auto", fills the micro-batch as train's
  // --micro-batch-size does (the accumulation then follows from train_batch_size).
  int64_t micro_batch = 0;
  int64_t seq_len = 0;  // 0: min(max_position_embeddings, 1024)
  // Also on when the config's activation_checkpointing section asks for cpu_checkpointing,
  // partition_activations or number_checkpoints.
  bool activation_checkpointing = false;
};

// Resolves `cfg`'s "auto" values for `model` and `in` (config::resolve_auto) and returns the
// ModelOptions to build the planned model with: micro batch, sequence length, parameter dtype
// (fp16 / bf16 / fp32 from the config), activation checkpointing, world size, planning_only
// (the model is planned, never run, so no memory per token is taken). Throws
// ConfigValidationError from resolve_auto. Shared by tools/outcore/cmd_estimate.cpp and
// python/bindings/estimate_binding.cpp so that both plan the same thing.
model::ModelOptions estimate_model_options(config::Config& cfg, const model::LlamaConfig& model,
                                           const EstimateInputs& in);

}  // namespace outcore::zero
