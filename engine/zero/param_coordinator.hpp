// Internal to engine/zero: stage 3's parameter partitions (ParamHome) and the coordinator that
// gathers whole unit slabs onto the device ahead of use and releases them after (DeepSpeed's
// PartitionedParameterCoordinator, without tracing: the pass schedule is known).
//
// A fetch of unit u:  [nvme: swap_in partition -> pinned fetch buffer]  (aio threads)
//                     partition -> own shard of a new device slab       (fetch stream)
//                     Comm::all_gather in place on the slab             (comm lane; world > 1)
// On a device the host cannot read, at world > 1, the comm lane gathers the ranks' partitions
// in pinned memory and copies the whole slab up on the comm stream instead (set_gather_buffer).
// Otherwise a fetch that must wait on the host first (for its swap read, or for the step gate)
// is issued by the fetch lane, a thread of the engine's own: it waits, then queues the copy on
// the fetch stream. No fetch waits as a host function of a device stream: on a GPU that would
// hold CUDA's one callback thread, and the step gate waits for the step's own device work.
// All decisions (what to fetch, prefetch, keep, release) are taken on the driving thread by
// ResidencyPolicy (residency.hpp) from bookkeeping alone, never from timing, so every rank
// issues the same collectives in the same order, and the planner replays the same decisions.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "common/aligned_buffer.hpp"
#include "engine/comm/comm.hpp"
#include "engine/device/device.hpp"
#include "engine/zero/geometry.hpp"
#include "engine/zero/host_lane.hpp"
#include "engine/zero/residency.hpp"
#include "swap/swap.hpp"

namespace outcore::zero::detail {

struct TrafficCounters {
  std::atomic<uint64_t> h2d{0};
  std::atomic<uint64_t> d2h{0};
};

// Where the low-precision partition of every unit lives between uses (stage 3), each unit in
// its own tier (g.placement.param_home: offload_param.max_in_cpu splits the units between host
// memory and swap files).
class ParamHome {
 public:
  // Per unit: kDevice: a device buffer; kPinned: a pool lease (pool non-null); kHost: a host
  // buffer; kNvme: the swapper's kParam file of the unit (swapper non-null).
  ParamHome(const Geometry& g, device::Device& device, swap::PinnedPool* pool,
            swap::Swapper* swapper);
  Tier tier(int unit) const { return g_.placement.param_home(static_cast<size_t>(unit)); }
  size_t bytes(int unit) const;  // partition bytes
  // The partition's memory (device or host) for kDevice / kPinned / kHost; nullptr for kNvme.
  std::byte* resident(int unit);
  // kNvme units: start reading / writing the partition; `buf` is a 4 KiB-aligned buffer of at
  // least align_up(bytes(unit), 4096) bytes.
  swap::SwapTicket start_read(int unit, std::byte* buf);
  swap::SwapTicket start_write(int unit, const std::byte* buf);
  // The swapper of the kNvme units (nullptr when there are none).
  swap::Swapper* swapper() const { return swapper_; }

 private:
  // One unit's partition; only the member of its tier is used.
  struct Partition {
    device::DeviceBuffer device;
    swap::PinnedBuffer pinned;
    AlignedBuffer host;
    swap::TensorId id;
  };
  const Geometry& g_;
  swap::Swapper* swapper_ = nullptr;
  std::vector<Partition> parts_;
};

class ParamCoordinator final : private ResidencyActions {
 public:
  // fetch_buffers: pinned staging for reads of the units in swap files (at least one when
  // there are such units, InvalidArgument otherwise; may be empty for other homes).
  // `comm_lane` runs the collectives (in issue order, as every rank issues them) and issues the
  // comm stream's copies of host gathers. `fetch_lane` waits for swap reads and the step gate and
  // then issues the fetches' copies; it must be joined before the step gate's target goes.
  ParamCoordinator(const Geometry& g, ParamHome& home, device::Device& device, device::Stream& copy,
                   device::Stream& comm_stream, HostLane& comm_lane, HostLane& fetch_lane,
                   comm::Comm& comm, std::vector<swap::PinnedBuffer> fetch_buffers,
                   TrafficCounters& traffic, CoordinatorOptions options);
  ~ParamCoordinator() override;

  // Starts a pass over `sched` (which must outlive the pass).
  void begin(const std::vector<PassStep>* sched) { policy_.begin(sched); }
  // Makes every unit step `i` needs resident and gathered (fetching what is missing, then
  // prefetching ahead), and waits for them. Rethrows a failed fetch's error.
  void acquire(size_t i) { policy_.acquire(i); }
  // The gathered slab of a unit acquired for the current step.
  const void* slab(int unit) const;
  // After step i computed: releases its units unless persistent or kept for reuse.
  void release(size_t i) { policy_.release(i); }
  // Ends the pass: waits for stray prefetches and releases every non-persistent slab.
  void end() { policy_.end(); }
  // Releases everything (the partitions changed). Waits for fetches in flight.
  void drop_all() { policy_.drop_all(); }

  uint64_t live_bytes() const { return policy_.live_bytes(); }

  // `wait` is called with a unit before its partition is read for a fetch (the engine waits
  // there for an optimizer step still writing that unit's new parameters); `pending` tells,
  // without blocking, whether that wait would block. A fetch of a pending unit does not block
  // the driving thread: the fetch lane waits, then reads and issues the copy; the decision to
  // fetch is taken as before, so collectives and traffic do not depend on timing. With host
  // gathers the driving thread waits before the fetch instead. Null: nothing to wait for.
  void set_step_gate(std::function<bool(int)> pending, std::function<void(int)> wait) {
    step_pending_ = std::move(pending);
    before_fetch_ = std::move(wait);
  }
  // Several ranks on a device the host cannot read (Geometry::host_gathers): every fetch
  // gathers the ranks' partitions in `buf` (pinned, one full slab) on the comm lane, then
  // copies the whole slab up and waits for the copy there. The lane runs one task at a time, so
  // one buffer serves (the publications' gathers share it).
  void set_gather_buffer(std::byte* buf) { gather_ = buf; }
  // The stream the model's compute is queued on (ComputeBackend::stream(); null: it finishes
  // as it is called): a slab is freed once the compute queued before its release has run
  // (Device::release_after), without the host waiting for it.
  void set_compute_stream(device::Stream* compute) { compute_ = compute; }

 private:
  struct Slot {
    device::DeviceBuffer buf;
    std::unique_ptr<device::Event> copied, ready;
    // world > 1: the comm lane's task that gathers the slab (it is ready once that has run);
    // 0: `ready` says.
    uint64_t gathered = 0;
    // The fetch lane's task that issues the copy and records its event (0: issued by the
    // driving thread).
    uint64_t fetched = 0;
  };

  void start_fetch(int unit, int fetch_buffer) override;
  void start_host_gather(int unit, int fetch_buffer);  // start_fetch with gather_ set
  // Queues the copy of a partition from its home (or its fetch buffer) on the fetch stream.
  void copy_partition(Tier tier, std::byte* own, const std::byte* src, size_t bytes);
  void wait_fetched(int unit) override;
  void free_slab(int unit) override;

  const Geometry& g_;
  ParamHome& home_;
  device::Device& device_;
  device::Stream& copy_;
  device::Stream& comm_stream_;
  HostLane& comm_lane_;
  HostLane& fetch_lane_;
  comm::Comm& comm_;
  std::vector<swap::PinnedBuffer> fetch_buffers_;
  TrafficCounters& traffic_;
  std::vector<Slot> slots_;
  std::function<bool(int)> step_pending_;
  std::function<void(int)> before_fetch_;
  std::byte* gather_ = nullptr;
  device::Stream* compute_ = nullptr;  // set_compute_stream
  ResidencyPolicy policy_;             // last: its calls reach the members above
};

}  // namespace outcore::zero::detail
