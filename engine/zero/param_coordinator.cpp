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
                                   HostLane& comm_lane, comm::Comm& comm,
                                   std::vector<swap::PinnedBuffer> fetch_buffers,
                                   TrafficCounters& traffic, CoordinatorOptions options)
    : g_(g),
      home_(home),
      device_(device),
      copy_(copy),
      comm_stream_(comm_stream),
      comm_lane_(comm_lane),
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
  if (defer && home_.tier(unit) != Tier::kNvme) {
    const std::function<void(int)>* wait = &before_fetch_;
    copy_.enqueue([wait, unit] {
      OUTCORE_TRACE_SPAN("step wait", "wait", {.unit = unit});
      (*wait)(unit);
    });
  }
  switch (home_.tier(unit)) {
    case Tier::kNvme:
      copy_.copy_h2d(own, read_partition(unit, fetch_buffer, defer), part_bytes);
      traffic_.h2d += part_bytes;
      break;
    case Tier::kDevice:
      copy_.copy_d2d(own, home_.resident(unit), part_bytes);
      break;
    case Tier::kPinned:
    case Tier::kHost:
      copy_.copy_h2d(own, home_.resident(unit), part_bytes);
      traffic_.h2d += part_bytes;
      break;
  }
  if (g_.world == 1) {
    // Nothing to gather: ready once copied.
    s.gathered = 0;
    copy_.record(*s.ready);
    return;
  }
  copy_.record(*s.copied);
  comm::Comm* c = &comm_;
  device::Event* copied = s.copied.get();
  s.gathered = comm_lane_.post([c, copied, slab, own, part_bytes, full_bytes] {
    copied->synchronize();
    c->all_gather_bytes({own, part_bytes}, {slab, full_bytes});
  });
}

const std::byte* ParamCoordinator::read_partition(int unit, int fetch_buffer, bool deferred) {
  std::byte* staging = fetch_buffers_.at(fetch_buffer).data();
  swap::Swapper* sw = home_.swapper();
  if (deferred) {
    const std::function<void(int)>* wait = &before_fetch_;
    ParamHome* home = &home_;
    copy_.enqueue([wait, home, sw, staging, unit] {
      {
        OUTCORE_TRACE_SPAN("step wait", "wait", {.unit = unit});
        (*wait)(unit);
      }
      const swap::SwapTicket t = home->start_read(unit, staging);
      OUTCORE_TRACE_SPAN("swap wait", "wait", {.unit = unit});
      sw->wait(t);
    });
    return staging;
  }
  const swap::SwapTicket t = home_.start_read(unit, staging);
  copy_.enqueue([sw, t, unit] {
    OUTCORE_TRACE_SPAN("swap wait", "wait", {.unit = unit});
    sw->wait(t);
  });
  return staging;
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
  if (s.gathered != 0)
    comm_lane_.wait_for(s.gathered);
  else
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
