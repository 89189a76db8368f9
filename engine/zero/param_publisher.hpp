// Internal to engine/zero: publication of new low-precision parameters (after Adam, at
// construction, on a checkpoint load) to the parameters' tier: straight into their home, or
// through a pinned staging slot then copied up, swapped out to NVMe, and at stages 1-2
// all-gathered from every rank on the engine's comm lane.
#pragma once

#include <algorithm>
#include <cstddef>
#include <memory>
#include <vector>

#include "engine/zero/geometry.hpp"
#include "engine/zero/param_coordinator.hpp"
#include "swap/swap.hpp"

namespace outcore::zero::detail {

// Rounds n fp32 values to the parameters' dtype (copies them for F32), as every publication
// does.
void to_param_dtype(const float* src, void* dst, DType dtype, size_t n);

// Owns: the staging slots (pinned buffer, copy event, pending swap write each) and the
// pinned gather buffer of several ranks on a device the host cannot read (lent to the
// coordinator for its fetches: the comm lane runs one gather, and its copy up, at a time).
// Borrows (must outlive it): the geometry, comm, the copy and comm streams, the comm lane, the
// parameters' storage (full slabs below stage 3, the ParamHome at stage 3) and the traffic
// counters.
//
// Threads: one caller at a time, no lock: the step worker (and its async unit tasks, which
// only write into a target returned here) while an overlapped step publishes, the driving
// thread otherwise (construction, checkpoint access, every call after the step was joined).
// The comm lane runs the gathers in issue order with the pass's collectives; with host gathers
// it issues the copy up on the comm stream too.
class ParamPublisher {
 public:
  // Acquires `slot_count` slots of `slot_bytes` from `pool`; `gather` may be empty.
  ParamPublisher(const Geometry& g, device::Device& device, comm::Comm& comm, device::Stream& copy,
                 device::Stream& comm_stream, HostLane& comm_lane,
                 std::vector<device::DeviceBuffer>& full_params, ParamHome* home,
                 TrafficCounters& traffic, swap::PinnedPool& pool, size_t slot_count,
                 size_t slot_bytes, swap::PinnedBuffer gather);
  // Waits for the slots' pending swap writes (errors logged, not thrown).
  ~ParamPublisher();

  // Who writes the new elements: code on the host, or the optimizer store's step (which
  // writes device memory on the device itself where the unit is stepped there).
  enum class Writer { kHost, kOptimizer };

  // Writes own_len new elements of `unit`, produced by `produce(out)` into `out`, to the
  // parameters' tier, in order with other publications; `slot` picks the staging slot.
  template <typename Produce>
  void publish(int unit, size_t slot, Produce&& produce, Writer writer = Writer::kHost) {
    bool staged = false;
    std::byte* out = target(unit, slot, staged, writer);
    produce(out);
    finish(unit, slot, staged);
  }
  // The two halves of publish(), for a producer running elsewhere: where to write the unit's
  // own elements (its home, or staging slot `slot` once that slot is free; `staged` says
  // which: optimizer_publication_staged for the optimizer, host_publication_staged for the
  // host), then
  // the copy, swap write or gather of what was written.
  std::byte* target(int unit, size_t slot, bool& staged, Writer writer);
  void finish(int unit, size_t slot, bool staged);
  // Waits until `unit`'s publication through `slot` is where the next pass reads it (the
  // slot's copy or swap write finished; at stages 1-2 the gather of every rank's partition).
  void wait_landed(int unit, size_t slot);
  // Waits for every publication (slots, copy stream, comm lane and stream).
  void wait_all();
  // Staging slots (at least 1 for the slot arithmetic of callers).
  size_t slot_count() const { return std::max<size_t>(1, slots_.size()); }
  // Slot 0's buffer, for reading a partition back from NVMe (after wait_all()).
  std::byte* staging() { return slots_.at(0).buf.data(); }
  // The gather buffer (null when not needed).
  std::byte* gather_buffer() { return gather_.valid() ? gather_.data() : nullptr; }

 private:
  void wait_slot(size_t slot);

  // A staging buffer and what still uses it.
  struct Slot {
    swap::PinnedBuffer buf;
    std::unique_ptr<device::Event> copied;
    bool copy_pending = false;
    // Host gathers: the comm lane's task that gathers the slot and copies the slab up (the
    // copy is pending until it has run; `copied` is not used).
    uint64_t gathered = 0;
    swap::SwapTicket write;
  };

  const Geometry& g_;
  device::Device& device_;
  comm::Comm& comm_;
  device::Stream& copy_;
  device::Stream& comm_stream_;
  HostLane& comm_lane_;
  std::vector<device::DeviceBuffer>& full_params_;
  ParamHome* home_;
  TrafficCounters& traffic_;
  std::vector<Slot> slots_;
  // Several ranks on a device the host cannot read: parameters are gathered here, then
  // copied up whole.
  swap::PinnedBuffer gather_;
};

}  // namespace outcore::zero::detail
