// Internal to engine/zero: pieces of the plan the engine builds its buffers from.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/config/config.hpp"
#include "engine/model/model.hpp"
#include "engine/zero/geometry.hpp"
#include "swap/swap.hpp"

namespace outcore::zero::detail {

// The swap files of the parameter partitions (one tensor "p" per unit) and of the optimizer
// state (swap::optimizer_file_spec per unit whose optimizer home is NVMe).
std::vector<swap::SwapFileSpec> param_swap_files(const Geometry& g);
std::vector<swap::SwapFileSpec> optimizer_swap_files(const Geometry& g);
// offload_optimizer.ratio < 1 at stage 3 with offload_optimizer cpu or nvme (DeepSpeed's
// partial offload): sets g.placement.device_optimizer_from, the first unit whose optimizer
// state stays on the device. The units before it are the longest prefix whose own elements
// are at most ratio x all own elements (ratio 0: none; ratio 1: all). With offload none and a
// ratio < 1 it changes nothing and, with `warn`, says so.
void split_optimizer_homes(const config::Config& cfg, Geometry& g, bool warn);
// Gradient accumulators on NVMe: one tensor "g" (accum_len fp32) per unit.
std::vector<swap::SwapFileSpec> grad_swap_files(const Geometry& g);

// How the pinned pool is carved. `reduced`: the smallest layout that still works (one fetch
// buffer, one optimizer step at a time), used when outcore.pinned_memory_mb is too small for
// the full one.
struct PinnedLayout {
  uint64_t param_partitions = 0;  // offload_param cpu with pin_memory: every partition
  size_t fetch_slots = 0;         // nvme parameters: staging for reads in flight
  uint64_t fetch_slot_bytes = 0;
  size_t writeback_slots = 0;  // staging for new low-precision parameters after Adam
  uint64_t writeback_slot_bytes = 0;
  unsigned optimizer_buffer_count = 0;  // nvme optimizer: OptimizerSwapper buffer_count
  size_t concurrent_steps = 0;          // unit steps running at once on NVMe state
  uint64_t optimizer_lease_bytes = 0;   // one step's lease
  size_t grad_slots = 0;  // NVMe gradients: accumulation staging and one per unit step
  uint64_t grad_slot_bytes = 0;
  uint64_t grad_copy_back_bytes = 0;  // a device the host cannot read: one gradient slab
  uint64_t param_gather_bytes = 0;    // and several ranks: one parameter slab
  uint64_t total() const;
};
PinnedLayout pinned_layout(const config::Config& cfg, const Geometry& g, bool reduced);
// The full layout, or the reduced one when outcore.pinned_memory_mb cannot hold the full one.
PinnedLayout effective_pinned_layout(const config::Config& cfg, const Geometry& g);

// The smallest device byte budget for gathered slabs that lets every step of every pass run.
uint64_t live_param_min_bytes(const model::LlamaModel& model, const Geometry& g,
                              const std::vector<bool>& persistent);

}  // namespace outcore::zero::detail
