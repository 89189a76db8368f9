#include "engine/zero/param_coordinator.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "common/error.hpp"

namespace outcore::zero::detail {

// ---- ParamHome ------------------------------------------------------------------------------

ParamHome::ParamHome(Tier tier, const Geometry& g, device::Device& device, swap::PinnedPool* pool,
                     swap::Swapper* swapper)
    : tier_(tier), g_(g), swapper_(swapper) {
  for (size_t u = 0; u < g.units.size(); ++u) {
    const size_t b = bytes(static_cast<int>(u));
    switch (tier) {
      case Tier::kDevice:
        device_.push_back(device.alloc(b, fmt::format("parameter partition of unit {}", u)));
        break;
      case Tier::kPinned:
        pinned_.push_back(pool->acquire(b));
        break;
      case Tier::kHost:
        host_.emplace_back(b);
        break;
      case Tier::kNvme:
        ids_.push_back(
            swapper->space().find(static_cast<uint32_t>(u), swap::SwapKind::kParam, "p"));
        break;
    }
  }
}

size_t ParamHome::bytes(int unit) const { return g_.units.at(unit).part * g_.param_bytes; }

std::byte* ParamHome::resident(int unit) {
  switch (tier_) {
    case Tier::kDevice:
      return device_.at(unit).as<std::byte>();
    case Tier::kPinned:
      return pinned_.at(unit).data();
    case Tier::kHost:
      return host_.at(unit).data();
    case Tier::kNvme:
      break;
  }
  return nullptr;
}

swap::SwapTicket ParamHome::start_read(int unit, std::byte* buf) {
  return swapper_->swap_in(ids_.at(unit), {buf, bytes(unit)});
}

swap::SwapTicket ParamHome::start_write(int unit, const std::byte* buf) {
  return swapper_->swap_out(ids_.at(unit), {buf, bytes(unit)});
}

// ---- ParamCoordinator -----------------------------------------------------------------------

ParamCoordinator::ParamCoordinator(const Geometry& g, ParamHome& home, device::Device& device,
                                   device::Stream& copy, device::Stream& comm_stream,
                                   comm::Comm& comm, std::vector<swap::PinnedBuffer> fetch_buffers,
                                   TrafficCounters& traffic, CoordinatorOptions options)
    : g_(g),
      home_(home),
      device_(device),
      copy_(copy),
      comm_stream_(comm_stream),
      comm_(comm),
      fetch_buffers_(std::move(fetch_buffers)),
      traffic_(traffic),
      options_(std::move(options)),
      slots_(g.units.size()) {
  for (size_t b = fetch_buffers_.size(); b-- > 0;)
    free_fetch_buffers_.push_back(static_cast<int>(b));
  for (Slot& s : slots_) {
    s.copied = device.create_event();
    s.ready = device.create_event();
  }
  if (home.tier() == Tier::kNvme && fetch_buffers_.empty())
    throw InvalidArgument("zero: parameters on NVMe need at least one pinned fetch buffer");
}

ParamCoordinator::~ParamCoordinator() = default;

uint64_t ParamCoordinator::slab_bytes(int unit) const {
  return device::charged_bytes(g_.units[unit].padded * g_.param_bytes);
}

bool ParamCoordinator::needed_by(size_t i, int unit) const {
  const std::vector<int>& n = (*sched_)[i].needs;
  return std::find(n.begin(), n.end(), unit) != n.end();
}

void ParamCoordinator::begin(const std::vector<PassStep>* sched) { sched_ = sched; }

void ParamCoordinator::fetch(int unit) {
  Slot& s = slots_[unit];
  const UnitGeometry& ug = g_.units[unit];
  const size_t part_bytes = ug.part * g_.param_bytes;
  const size_t full_bytes = ug.padded * g_.param_bytes;
  if (home_.tier() == Tier::kNvme && free_fetch_buffers_.empty()) {
    // Every fetch buffer is held by a prefetch in flight: wait for one (it stays resident).
    for (size_t u = 0; u < slots_.size(); ++u)
      if (slots_[u].fetch_buffer >= 0) {
        wait_ready(static_cast<int>(u));
        break;
      }
  }
  s.buf = device_.alloc(full_bytes, fmt::format("gathered parameters of unit {}", unit));
  live_bytes_ += slab_bytes(unit);
  live_numel_ += ug.padded;
  s.state = State::kFetching;
  s.kept = false;
  std::byte* slab = s.buf.as<std::byte>();
  std::byte* own = slab + static_cast<size_t>(g_.rank) * part_bytes;
  switch (home_.tier()) {
    case Tier::kNvme: {
      s.fetch_buffer = free_fetch_buffers_.back();
      free_fetch_buffers_.pop_back();
      std::byte* staging = fetch_buffers_[s.fetch_buffer].data();
      const swap::SwapTicket t = home_.start_read(unit, staging);
      swap::Swapper* sw = home_.swapper();
      copy_.enqueue([sw, t] { sw->wait(t); });
      copy_.copy_h2d(own, staging, part_bytes);
      traffic_.h2d += part_bytes;
      break;
    }
    case Tier::kDevice:
      copy_.copy_d2d(own, home_.resident(unit), part_bytes);
      break;
    case Tier::kPinned:
    case Tier::kHost:
      copy_.copy_h2d(own, home_.resident(unit), part_bytes);
      traffic_.h2d += part_bytes;
      break;
  }
  copy_.record(*s.copied);
  comm_stream_.wait(*s.copied);
  comm::Comm* c = &comm_;
  comm_stream_.enqueue([c, slab, own, part_bytes, full_bytes] {
    c->all_gather_bytes({own, part_bytes}, {slab, full_bytes});
  });
  comm_stream_.record(*s.ready);
}

void ParamCoordinator::wait_ready(int unit) {
  Slot& s = slots_[unit];
  if (s.state != State::kFetching) return;
  s.ready->synchronize();
  s.state = State::kReady;
  if (s.fetch_buffer >= 0) {
    free_fetch_buffers_.push_back(s.fetch_buffer);
    s.fetch_buffer = -1;
  }
}

void ParamCoordinator::free_slab(int unit) {
  Slot& s = slots_[unit];
  if (s.state == State::kAbsent) return;
  wait_ready(unit);
  s.buf.reset();
  live_bytes_ -= slab_bytes(unit);
  live_numel_ -= g_.units[unit].padded;
  s.state = State::kAbsent;
  s.kept = false;
}

bool ParamCoordinator::evict_one(size_t i) {
  int victim = -1;
  size_t farthest = 0;
  for (size_t u = 0; u < slots_.size(); ++u) {
    const int unit = static_cast<int>(u);
    if (!slots_[u].kept || needed_by(i, unit)) continue;
    const size_t next = next_use(*sched_, i, unit);
    if (victim < 0 || next > farthest) victim = unit, farthest = next;
  }
  if (victim < 0) return false;
  free_slab(victim);
  return true;
}

void ParamCoordinator::prefetch(size_t i) {
  if (options_.prefetch_bucket_numel == 0) return;
  uint64_t in_flight = 0;
  for (size_t u = 0; u < slots_.size(); ++u)
    if (slots_[u].state == State::kFetching) in_flight += g_.units[u].padded;
  for (size_t j = i + 1; j < sched_->size(); ++j) {
    for (int u : (*sched_)[j].needs) {
      if (slots_[u].state != State::kAbsent) continue;
      const uint64_t n = g_.units[u].padded;
      if (in_flight + n > options_.prefetch_bucket_numel) return;
      if (live_numel_ + n > options_.max_live_numel) return;
      if (live_bytes_ + slab_bytes(u) > options_.budget_bytes) return;
      if (home_.tier() == Tier::kNvme && free_fetch_buffers_.empty()) return;
      fetch(u);
      in_flight += n;
    }
  }
}

void ParamCoordinator::acquire(size_t i) {
  for (int u : (*sched_)[i].needs) {
    Slot& s = slots_[u];
    s.kept = false;
    if (s.state != State::kAbsent) continue;
    while (live_bytes_ + slab_bytes(u) > options_.budget_bytes && evict_one(i)) {
    }
    fetch(u);
  }
  prefetch(i);
  for (int u : (*sched_)[i].needs) wait_ready(u);
}

const void* ParamCoordinator::slab(int unit) const {
  const Slot& s = slots_.at(unit);
  if (s.state != State::kReady)
    throw InvalidArgument(fmt::format("zero: unit {}'s parameters are not gathered", unit));
  return s.buf.data();
}

void ParamCoordinator::release(size_t i) {
  for (int u : (*sched_)[i].needs) {
    if (options_.persistent[u]) continue;
    if (keep_for_reuse(*sched_, g_, i, u, options_.max_reuse_distance) &&
        live_numel_ <= options_.max_live_numel) {
      slots_[u].kept = true;
      continue;
    }
    free_slab(u);
  }
}

void ParamCoordinator::end() {
  for (size_t u = 0; u < slots_.size(); ++u) {
    wait_ready(static_cast<int>(u));
    if (!options_.persistent[u]) free_slab(static_cast<int>(u));
  }
  sched_ = nullptr;
}

void ParamCoordinator::drop_all() {
  for (size_t u = 0; u < slots_.size(); ++u) free_slab(static_cast<int>(u));
}

}  // namespace outcore::zero::detail
