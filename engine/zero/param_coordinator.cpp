#include "engine/zero/param_coordinator.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "common/error.hpp"
#include "common/trace.hpp"

namespace outcore::zero::detail {

// ---- ParamHome ------------------------------------------------------------------------------

ParamHome::ParamHome(const Geometry& g, device::Device& device, swap::PinnedPool* pool,
                     swap::Swapper* swapper)
    : g_(g), swapper_(swapper), parts_(g.units.size()) {
  for (size_t u = 0; u < g.units.size(); ++u) {
    const int unit = static_cast<int>(u);
    const size_t b = bytes(unit);
    Partition& p = parts_[u];
    switch (tier(unit)) {
      case Tier::kDevice:
        p.device = device.alloc(b, fmt::format("parameter partition of unit {}", u));
        break;
      case Tier::kPinned:
        p.pinned = pool->acquire(b);
        break;
      case Tier::kHost:
        p.host = AlignedBuffer(b);
        break;
      case Tier::kNvme:
        p.id = swapper->space().find(static_cast<uint32_t>(u), swap::SwapKind::kParam, "p");
        break;
    }
  }
}

size_t ParamHome::bytes(int unit) const { return g_.units.at(unit).part * g_.param_bytes; }

std::byte* ParamHome::resident(int unit) {
  Partition& p = parts_.at(unit);
  switch (tier(unit)) {
    case Tier::kDevice:
      return p.device.as<std::byte>();
    case Tier::kPinned:
      return p.pinned.data();
    case Tier::kHost:
      return p.host.data();
    case Tier::kNvme:
      break;
  }
  return nullptr;
}

swap::SwapTicket ParamHome::start_read(int unit, std::byte* buf) {
  return swapper_->swap_in(parts_.at(unit).id, {buf, bytes(unit)});
}

swap::SwapTicket ParamHome::start_write(int unit, const std::byte* buf) {
  return swapper_->swap_out(parts_.at(unit).id, {buf, bytes(unit)});
}

// ---- ParamCoordinator -----------------------------------------------------------------------

ParamCoordinator::ParamCoordinator(const Geometry& g, ParamHome& home, device::Device& device,
                                   device::Stream& copy, device::Stream& comm_stream,
                                   HostLane& comm_lane, HostLane& fetch_lane, comm::Comm& comm,
                                   std::vector<swap::PinnedBuffer> fetch_buffers,
                                   TrafficCounters& traffic, CoordinatorOptions options)
    : g_(g),
      home_(home),
      device_(device),
      copy_(copy),
      comm_stream_(comm_stream),
      comm_lane_(comm_lane),
      fetch_lane_(fetch_lane),
      comm_(comm),
      fetch_buffers_(std::move(fetch_buffers)),
      traffic_(traffic),
      slots_(g.units.size()),
      policy_(g, std::move(options), fetch_buffers_.size(), *this) {
  for (Slot& s : slots_) {
    s.copied = device.create_event();
    s.ready = device.create_event();
  }
}

ParamCoordinator::~ParamCoordinator() = default;

void ParamCoordinator::start_fetch(int unit, int fetch_buffer) {
  // Host gathers read the staging buffer on the comm lane, whose collectives keep the issue
  // order of every rank: their step gate waits here.
  const bool defer = gather_ == nullptr && step_pending_ && step_pending_(unit);
  if (!defer && before_fetch_) before_fetch_(unit);
  Slot& s = slots_[unit];
  const UnitGeometry& ug = g_.units[unit];
  const size_t part_bytes = ug.part * g_.param_bytes;
  const size_t full_bytes = ug.padded * g_.param_bytes;
  s.buf = device_.alloc(full_bytes, fmt::format("gathered parameters of unit {}", unit));
  if (gather_ != nullptr) return start_host_gather(unit, fetch_buffer);
  std::byte* slab = s.buf.as<std::byte>();
  std::byte* own = slab + static_cast<size_t>(g_.rank) * part_bytes;
  const Tier tier = home_.tier(unit);
  if (tier != Tier::kDevice) traffic_.h2d += part_bytes;
  // At world 1 the slab is ready once copied.
  device::Event* copied = g_.world == 1 ? s.ready.get() : s.copied.get();
  s.fetched = 0;
  if (!defer && tier != Tier::kNvme) {
    copy_partition(tier, own, home_.resident(unit), part_bytes);
    copy_.record(*copied);
  } else {
    // Host waits first (the step gate, the swap read): on the fetch lane, which then issues the
    // copy. The read of a unit not gated starts now.
    std::byte* staging = tier == Tier::kNvme ? fetch_buffers_.at(fetch_buffer).data() : nullptr;
    const swap::SwapTicket read =
        staging != nullptr && !defer ? home_.start_read(unit, staging) : swap::SwapTicket{};
    s.fetched = fetch_lane_.post([this, unit, defer, tier, staging, read, own, part_bytes, copied] {
      if (defer) {
        OUTCORE_TRACE_SPAN("step wait", "wait", {.unit = unit});
        before_fetch_(unit);
      }
      const std::byte* src = home_.resident(unit);
      if (staging != nullptr) {
        const swap::SwapTicket t = read.valid() ? read : home_.start_read(unit, staging);
        OUTCORE_TRACE_SPAN("swap wait", "wait", {.unit = unit});
        home_.swapper()->wait(t);
        src = staging;
      }
      copy_partition(tier, own, src, part_bytes);
      copy_.record(*copied);
    });
  }
  if (g_.world == 1) {
    s.gathered = 0;
    return;
  }
  comm::Comm* c = &comm_;
  HostLane* fetch_lane = &fetch_lane_;
  const uint64_t fetched = s.fetched;
  s.gathered = comm_lane_.post([c, fetch_lane, fetched, copied, slab, own, part_bytes, full_bytes] {
    if (fetched != 0) fetch_lane->wait_for(fetched);  // the copy is issued, `copied` recorded
    copied->synchronize();
    c->all_gather_bytes({own, part_bytes}, {slab, full_bytes});
  });
}

void ParamCoordinator::copy_partition(Tier tier, std::byte* own, const std::byte* src,
                                      size_t bytes) {
  if (tier == Tier::kDevice)
    copy_.copy_d2d(own, src, bytes);
  else
    copy_.copy_h2d(own, src, bytes);
}

void ParamCoordinator::start_host_gather(int unit, int fetch_buffer) {
  Slot& s = slots_[unit];
  const UnitGeometry& ug = g_.units[unit];
  const size_t part_bytes = ug.part * g_.param_bytes;
  const size_t full_bytes = ug.padded * g_.param_bytes;
  std::byte* gather = gather_;
  std::byte* own = gather + static_cast<size_t>(g_.rank) * part_bytes;
  const std::byte* src = nullptr;       // this rank's partition in host memory
  const std::byte* resident = nullptr;  // ... or on the device, copied down first
  swap::Swapper* sw = home_.swapper();
  swap::SwapTicket read;
  switch (home_.tier(unit)) {
    case Tier::kNvme:
      src = fetch_buffers_.at(fetch_buffer).data();
      read = home_.start_read(unit, fetch_buffers_.at(fetch_buffer).data());
      break;
    case Tier::kDevice:
      resident = home_.resident(unit);
      src = own;
      traffic_.d2h += part_bytes;
      break;
    case Tier::kPinned:
    case Tier::kHost:
      src = home_.resident(unit);
      break;
  }
  traffic_.h2d += full_bytes;
  // On the comm lane: the read waited for, the gather, the copy up, and the wait for it (the
  // next gather reuses the buffer). The slab is ready once the task has run.
  comm::Comm* c = &comm_;
  device::Stream* stream = &comm_stream_;
  std::byte* slab = s.buf.as<std::byte>();
  s.gathered = comm_lane_.post(
      [c, stream, sw, read, resident, src, own, gather, slab, unit, part_bytes, full_bytes] {
        if (read.valid()) {
          OUTCORE_TRACE_SPAN("swap wait", "wait", {.unit = unit});
          sw->wait(read);
        }
        if (resident != nullptr) {
          stream->copy_d2h(own, resident, part_bytes);
          stream->synchronize();
        }
        c->all_gather_bytes({src, part_bytes}, {gather, full_bytes});
        stream->copy_h2d(slab, gather, full_bytes);
        stream->synchronize();
      });
}

void ParamCoordinator::wait_fetched(int unit) {
  OUTCORE_TRACE_SPAN("param wait", "wait", {.unit = unit});
  const Slot& s = slots_[unit];
  if (s.gathered != 0) {
    comm_lane_.wait_for(s.gathered);
    return;
  }
  if (s.fetched != 0) fetch_lane_.wait_for(s.fetched);  // then `ready` is recorded
  s.ready->synchronize();
}

void ParamCoordinator::free_slab(int unit) {
  // The units queued on the backend may still read the slab: its memory is freed once they
  // have run, without waiting for them here (its bytes leave the budget's count now, as the
  // plan counts them; an allocation that needs the memory waits for it).
  if (compute_ == nullptr) {
    slots_[unit].buf.reset();
    return;
  }
  std::unique_ptr<device::Event> read = device_.create_event();
  compute_->record(*read);
  device_.release_after(std::move(slots_[unit].buf), std::move(read));
}

const void* ParamCoordinator::slab(int unit) const {
  if (!policy_.ready(unit))
    throw InvalidArgument(fmt::format("zero: unit {}'s parameters are not gathered", unit));
  return slots_.at(unit).buf.data();
}

}  // namespace outcore::zero::detail
