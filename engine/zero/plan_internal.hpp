// Internal to engine/zero: pieces of the plan the engine builds its buffers from. Above
// geometry.hpp (whose per-unit decisions it sizes), below the engine.
#pragma once

#include <cstddef>
#include <cstdint>

#include "engine/config/config.hpp"
#include "engine/zero/geometry.hpp"

namespace outcore::zero::detail {

// How the pinned pool is carved.
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
  // A device the host cannot read: buffers gradient slabs come down to, one slab each
  // (kGradCopyBackSlots; one in the reduced layout); none when every unit's gradients stay on
  // the device (grads_come_down).
  size_t grad_copy_back_slots = 0;
  uint64_t grad_copy_back_bytes = 0;
  uint64_t param_gather_bytes = 0;  // and several ranks: one parameter slab
  uint64_t total() const;
};
// Which pinned layout: the full one, or the smallest one that still works (one fetch buffer,
// one optimizer step at a time), used when outcore.pinned_memory_mb is too small for the full
// one.
enum class PinnedLayoutSize : uint8_t { kFull, kReduced };

// The pinned pool's carving for `g`'s placement and Plan::device_grad_sums (`device_sums`,
// which decide whether gradients come down at all), of the given size.
PinnedLayout pinned_layout(const config::Config& cfg, const Geometry& g,
                           const std::vector<bool>& device_sums, PinnedLayoutSize size);
// The full layout when outcore.pinned_memory_mb holds it; else the full layout with as many
// parameter fetch buffers as fit (fewer than offload_param.buffer_count), unless the reduced
// layout (one unit step at a time) holds more of them; at least one, even where the limit cannot
// hold that (the plan then refuses it).
PinnedLayout effective_pinned_layout(const config::Config& cfg, const Geometry& g,
                                     const std::vector<bool>& device_sums);

}  // namespace outcore::zero::detail
