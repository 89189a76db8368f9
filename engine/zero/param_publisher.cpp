// Publication of new low-precision parameters to their tier.
#include "engine/zero/param_publisher.hpp"

#include <cstring>
#include <utility>

#include "common/log.hpp"
#include "engine/model/model.hpp"

namespace outcore::zero::detail {

void to_param_dtype(const float* src, void* dst, DType dtype, size_t n) {
  if (dtype == DType::F32)
    std::memcpy(dst, src, n * sizeof(float));
  else
    model::convert_from_fp32(src, dst, dtype, n);
}

ParamPublisher::ParamPublisher(const Geometry& g, device::Device& device, comm::Comm& comm,
                               device::Stream& copy, device::Stream& comm_stream,
                               HostLane& comm_lane, std::vector<device::DeviceBuffer>& full_params,
                               ParamHome* home, TrafficCounters& traffic, swap::PinnedPool& pool,
                               size_t slot_count, size_t slot_bytes, swap::PinnedBuffer gather)
    : g_(g),
      device_(device),
      comm_(comm),
      copy_(copy),
      comm_stream_(comm_stream),
      comm_lane_(comm_lane),
      full_params_(full_params),
      home_(home),
      traffic_(traffic),
      gather_(std::move(gather)) {
  for (size_t k = 0; k < slot_count; ++k)
    slots_.push_back({pool.acquire(slot_bytes), device.create_event(), false, 0, {}});
}

ParamPublisher::~ParamPublisher() {
  for (Slot& s : slots_) {
    if (!s.write.valid()) continue;
    try {
      home_->swapper()->wait(s.write);
    } catch (const std::exception& e) {
      log::warn("zero: shutting down: {}", e.what());
    }
  }
}

void ParamPublisher::wait_slot(size_t slot) {
  Slot& s = slots_[slot];
  if (s.copy_pending) {
    s.copy_pending = false;
    if (s.gathered != 0)
      comm_lane_.wait_for(std::exchange(s.gathered, 0));
    else
      s.copied->synchronize();
  }
  if (s.write.valid()) {
    const swap::SwapTicket t = s.write;
    s.write = {};
    home_->swapper()->wait(t);
  }
}

void ParamPublisher::wait_all() {
  for (size_t k = 0; k < slots_.size(); ++k) wait_slot(k);
  copy_.synchronize();
  comm_lane_.wait();
  comm_stream_.synchronize();
}

void ParamPublisher::wait_landed(int unit, size_t slot) {
  if (optimizer_publication_staged(g_, static_cast<size_t>(unit))) wait_slot(slot);
  if (g_.placement.stage == 1 || g_.placement.stage == 2) comm_lane_.wait();
}

// Straight into the parameters' home when the optimizer can write there, else into staging
// slot `slot` (then copied or swapped out).
std::byte* ParamPublisher::target(int unit, size_t slot, bool& staged, Writer writer) {
  const UnitGeometry& ug = g_.units[unit];
  staged = writer == Writer::kHost ? host_publication_staged(g_, static_cast<size_t>(unit))
                                   : optimizer_publication_staged(g_, static_cast<size_t>(unit));
  if (!staged)
    return g_.placement.stage < 3 ? full_params_[unit].as<std::byte>() + ug.own_off * g_.param_bytes
                                  : home_->resident(unit);
  wait_slot(slot);
  return slots_.at(slot).buf.data();
}

void ParamPublisher::finish(int unit, size_t slot, bool staged) {
  const Placement& p = g_.placement;
  const UnitGeometry& ug = g_.units[unit];
  const size_t bytes = ug.own_len * g_.param_bytes;
  Slot* s = staged ? &slots_.at(slot) : nullptr;
  const bool host_gather = g_.host_gathers_publications();
  if (staged) {
    if (p.stage == 3 && home_->tier(unit) == Tier::kNvme) {
      s->write = home_->start_write(unit, s->buf.data());
    } else if (!host_gather) {
      std::byte* dst = p.stage < 3
                           ? full_params_[unit].as<std::byte>() + ug.own_off * g_.param_bytes
                           : home_->resident(unit);
      copy_.copy_h2d(dst, s->buf.data(), bytes);
      traffic_.h2d += bytes;
      copy_.record(*s->copied);
      s->copy_pending = true;
    }
  }
  if (host_gather) {
    // The device's memory is not the host's: gather in pinned memory on the comm lane (one
    // task at a time, each waiting for its copy up, so one buffer serves), then copy the whole
    // slab up. Staged is true here: every publication is, under host gathers
    // (optimizer_publication_staged).
    std::byte* gather = gather_.data();
    const std::byte* src = s->buf.data();
    const size_t full_bytes = ug.padded * g_.param_bytes;
    comm::Comm* c = &comm_;
    device::Stream* stream = &comm_stream_;
    std::byte* dst = full_params_[unit].as<std::byte>();
    s->gathered = comm_lane_.post([c, stream, src, gather, dst, bytes, full_bytes] {
      c->all_gather_bytes({src, bytes}, {gather, full_bytes});
      stream->copy_h2d(dst, gather, full_bytes);
      stream->synchronize();
    });
    traffic_.h2d += full_bytes;
    s->copy_pending = true;
    return;
  }
  if ((p.stage == 1 || p.stage == 2) && g_.world > 1) {
    // Every rank holds the full slab: gather the other ranks' new partitions.
    std::byte* full = full_params_[unit].as<std::byte>();
    std::byte* own = full + ug.own_off * g_.param_bytes;
    const size_t full_bytes = ug.padded * g_.param_bytes;
    // This publication's copy up (the slot's event may be recorded again by the next one before
    // the lane runs the gather).
    std::shared_ptr<device::Event> copied;
    if (staged) {
      copied = device_.create_event();
      copy_.record(*copied);
    }
    comm::Comm* c = &comm_;
    comm_lane_.post([c, copied, full, own, bytes, full_bytes] {
      if (copied != nullptr) copied->synchronize();
      c->all_gather_bytes({own, bytes}, {full, full_bytes});
    });
  }
}

}  // namespace outcore::zero::detail
