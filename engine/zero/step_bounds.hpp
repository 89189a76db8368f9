// What bounds one training step on this machine, from the plan's bytes, FLOPs and optimizer
// elements and the rates of the machine's links (`outcore estimate` prints it): the GEMMs'
// compute, the host<->device copies over PCIe, the drive's reads and writes, and CPU Adam over
// the optimizer state it steps. A step cannot be faster than the slowest of the four. The
// transfers are hidden when compute takes at least as long as each of them; CPU Adam is not,
// whatever the compute: each unit's update runs under the next step's first forward, which
// waits for it (decision 001), so only that forward can cover it (with outcore.step_in_backward,
// Plan::step_in_backward, the backward of the step's last micro-batch before it, decision 002).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "engine/config/config.hpp"
#include "engine/device/compute_backend.hpp"
#include "engine/device/device.hpp"
#include "engine/model/model.hpp"
#include "engine/zero/plan.hpp"

namespace outcore::zero {

struct LinkRates {
  double gemm_flops = 0;         // FLOP/s of the model's GEMMs (its compute dtype) on the device
  double attention_flops = 0;    // model FLOP/s of its attention there; 0: at gemm_flops
  double pcie_bytes = 0;         // bytes/s host<->device; 0: no copies cross a bus (host device)
  double drive_read_bytes = 0;   // bytes/s the swap drive reads; 0: unknown
  double drive_write_bytes = 0;  // bytes/s the swap drive writes; 0: unknown
  double adam_elems = 0;         // elements/s CPU Adam steps (measure_adam_rate); 0: not counted
};

struct StepTimes {
  double flops = 0;            // FLOPs of the step (forward + backward + recomputation)
  double attention_flops = 0;  // the attention's part of them
  double gemm_s = 0;           // (flops - attention_flops) / gemm_flops
  double attention_s = 0;      // attention_flops / attention_flops rate (else the GEMM rate)
  double compute_s = 0;        // gemm_s + attention_s
  double pcie_s = 0;           // (h2d + d2h) / pcie_bytes
  double drive_s = 0;          // nvme_read / read rate + nvme_write / write rate
  bool drive_known = true;     // false when the plan moves NVMe bytes and no drive rate is given
  uint64_t adam_elems = 0;     // cpu_adam_elems(plan)
  double adam_s = 0;           // adam_elems / rates.adam_elems (0 when not counted)
  double bound_s() const;      // the largest of the four
  // "compute", "PCIe", "drive" or "CPU Adam": which one bounds the step.
  std::string bound() const;
  // True when compute takes at least as long as each transfer (they can hide under it).
  bool transfers_hidden() const { return compute_s >= pcie_s && compute_s >= drive_s; }
};

// The step of `plan` (for `model`, whose options give the micro-batch and checkpointing) at
// `rates`: the GEMMs at the GEMM rate, the attention at its own. Activation checkpointing adds
// each decoder's forward but its down projection (LlamaConfig::recompute_flops_per_token).
StepTimes step_times(const Plan& plan, const model::LlamaModel& model, const LinkRates& rates);

// Optimizer elements CPU Adam steps per step: all of them on a device in host memory, those
// offloaded on a GPU (Plan::device_host_accessible false: the rest are stepped there, decision
// 036).
uint64_t cpu_adam_elems(const Plan& plan);

// Elements per second of cpu_adam::adam_step as the engine of `cfg` runs it on this machine:
// its CPU threads (cpu_threads_for offload_optimizer.cpuadam_cores_perc), its moments' dtype,
// fp32 gradients and a copy-out in `param_dtype` (none for F32), over `elems` elements (best of
// three steps after an untimed one; the arrays take about 18 bytes per element).
double measure_adam_rate(const config::Config& cfg, DType param_dtype,
                         size_t elems = size_t{1} << 24);

// The attention whose rate stands for `model`'s (device::attention_flops): one sequence of its
// decoder attention (heads, head size, block, operand dtype) of min(seq_len, max_tokens) tokens.
device::ComputeBackend::Attention rate_attention(const model::LlamaModel& model,
                                                 int64_t max_tokens);

// The sizes the compute rates are measured at on `device`: GEMMs of gemm_n^3 and the model's
// attention on one sequence of up to attention_tokens tokens (a GPU: 4096 and 4096, a few
// milliseconds; the host's cores: 1024 and 512).
struct RateShapes {
  int64_t gemm_n = 0, attention_tokens = 0;
};
RateShapes rate_shapes(const device::Device& device);

// Measures on `device`, at rate_shapes(device), whichever of rates.gemm_flops (device::gemm_flops
// in the model's compute dtype) and rates.attention_flops (device::attention_flops of
// rate_attention) is still 0.
void measure_compute_rates(device::Device& device, const model::LlamaModel& model,
                           LinkRates& rates);

// What the CUDA backend keeps on a GPU computing `model` (the plan's "compute backend" item,
// device::backend_workspace).
uint64_t cuda_workspace_bytes(const model::LlamaModel& model);

// The step of `cfg` with its batch keys set to `micro` sequences per micro-batch and `gas`
// micro-batches per step, for a model of `mc` with `mo` (its micro-batch replaced; on a device
// the host cannot read, the head's rows sized for that micro-batch from `head_bytes`
// (model::head_sizing_bytes) and the CUDA backend's workspace with them, as training sizes
// them), planned with `po` against this machine's limits and, when `device_limit` > 0, that
// device limit. nullopt when the plan does not fit.
std::optional<StepTimes> shape_times(const config::Config& cfg, const model::LlamaConfig& mc,
                                     model::ModelOptions mo, int64_t micro, int64_t gas,
                                     const PlanOptions& po, uint64_t device_limit,
                                     uint64_t head_bytes, const LinkRates& rates);

// A batch shape and its step.
struct ShapeChoice {
  int64_t micro = 0, gas = 0;
  StepTimes times;
  bool hides = false;  // compute covers every transfer
};
// Over micro-batches 1, 2, 4 .. 64 and accumulation steps 1, 2, 4 .. 128 (shape_times): the
// fewest tokens per step whose compute covers every transfer (`hides`), else the shape whose
// compute comes closest to the larger transfer; nullopt when no micro-batch fits. What `outcore
// estimate` recommends.
std::optional<ShapeChoice> choose_shape(const config::Config& cfg, const model::LlamaConfig& mc,
                                        const model::ModelOptions& mo, const PlanOptions& po,
                                        uint64_t device_limit, uint64_t head_bytes,
                                        const LinkRates& rates);

}  // namespace outcore::zero
