// engine/zero placement types: the tiers training state can live in, and where each kind of
// state lives between uses (its home). The bottom of engine/zero: it includes nothing of the
// layer. The geometry (geometry.hpp) decides a Placement for a config and a model, the planner
// (plan.hpp) counts bytes per Tier from it, the engine allocates by it.
//
// Tiers:
//   device  the accelerator's budgeted allocator (outcore.device_memory_mb)
//   pinned  the pinned host pool (swap::PinnedPool; outcore.pinned_memory_mb, 0 = sized here)
//   host    other host RAM the engine allocates (fp32 state with offload cpu, accumulators)
//   nvme    swap files under offload_param.nvme_path / offload_optimizer.nvme_path
//
// Threading: plain values; every function here is pure and thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "common/dtype.hpp"

namespace outcore::zero {

enum class Tier : uint8_t { kDevice, kPinned, kHost, kNvme };
inline constexpr int kNumTiers = 4;

// "device", "pinned", "host", "nvme".
constexpr std::string_view tier_name(Tier t) {
  switch (t) {
    case Tier::kDevice:
      return "device";
    case Tier::kPinned:
      return "pinned";
    case Tier::kHost:
      return "host";
    case Tier::kNvme:
      return "nvme";
  }
  return "?";
}

// Where the fp32 gradient accumulators go when the optimizer state is on NVMe.
//   kAuto  NVMe when they would take more than a quarter of the available host memory
//          (MemAvailable, or what the memory cgroup leaves where less), else host memory
//   kHost  host memory
//   kNvme  swap files under offload_optimizer.nvme_path (<...>/grad/<unit>.bin): each
//          micro-batch reads, adds and writes back its partition; the step reads it once
enum class GradientPlacement : uint8_t { kAuto, kHost, kNvme };

// Where each kind of state lives between uses (the "home" of each partition).
struct Placement {
  int stage = 0;                   // effective ZeRO stage, 0..3
  DType param_dtype = DType::F32;  // compute dtype of the low-precision parameters
  // Low-precision parameters: full slabs on the device below stage 3; at stage 3 the home of
  // the partitions per offload_param.device (none: kDevice; cpu: kPinned with pin_memory, else
  // kHost; nvme: kNvme, though some units may be in host memory, see below).
  Tier params = Tier::kDevice;
  // Stage 3 with offload_param nvme (else 0): the first `host_param_units` units, the longest
  // prefix whose partitions fit together in offload_param.max_in_cpu elements, live in host
  // memory (`host_params`: kPinned with offload_param.pin_memory, else kHost); the other
  // `nvme_param_units` in swap files.
  size_t host_param_units = 0;
  size_t nvme_param_units = 0;
  Tier host_params = Tier::kPinned;
  // fp32 master weights + Adam moments: where offload_optimizer.device puts them.
  Tier optimizer = Tier::kDevice;
  // Partial offload (offload_optimizer.ratio < 1, stage 3 with offload cpu or nvme, DeepSpeed's
  // ZeRO-Offload++): units from `device_optimizer_from` on keep their optimizer state on the
  // device and are stepped there; the units before it, the longest prefix whose own elements
  // are at most ratio x all own elements, keep it in `optimizer`. Every unit otherwise.
  size_t device_optimizer_from = SIZE_MAX;
  // fp32 gradient accumulators: with the optimizer on the device, the device (host memory when
  // the host cannot read the device: make_geometry; there the planner keeps the gradients of
  // units stepped on the device on it where the budget allows, Plan::device_grad_sums); else
  // host memory, or NVMe swap files next to the optimizer state (see GradientPlacement).
  Tier gradients = Tier::kDevice;
  // True when offload_optimizer.device is nvme below stage 3: as in DeepSpeed, the state is
  // kept in host memory as with "cpu" (engine/config warns about it).
  bool optimizer_nvme_below_stage3 = false;

  // Where unit `unit`'s low-precision parameters live between uses (`params`, or
  // `host_params` for the units kept in host memory by max_in_cpu).
  Tier param_home(size_t unit) const { return unit < host_param_units ? host_params : params; }
  // Where unit `unit`'s optimizer state lives (`optimizer`, or the device for the units that
  // offload_optimizer.ratio keeps there).
  Tier optimizer_home(size_t unit) const {
    return unit >= device_optimizer_from ? Tier::kDevice : optimizer;
  }
};

}  // namespace outcore::zero
