#include "engine/zero/residency.hpp"

#include <algorithm>

#include "engine/device/device.hpp"

namespace outcore::zero::detail {

CoordinatorOptions coordinator_options(const config::Config& cfg, const Geometry& g,
                                       uint64_t budget_bytes) {
  const config::ZeroConfig& z = cfg.zero_optimization;
  CoordinatorOptions co;
  co.budget_bytes = budget_bytes;
  co.max_live_numel = static_cast<uint64_t>(std::max<int64_t>(0, z.stage3_max_live_parameters));
  co.prefetch_bucket_numel = static_cast<uint64_t>(
      std::max<int64_t>(0, z.stage3_prefetch_bucket_size.value_or(50'000'000)));
  co.max_reuse_distance = static_cast<uint64_t>(std::max<int64_t>(0, z.stage3_max_reuse_distance));
  co.persistent = persistent_units(cfg, g);
  return co;
}

ResidencyPolicy::ResidencyPolicy(const Geometry& g, CoordinatorOptions options,
                                 size_t fetch_buffers, ResidencyActions& actions)
    : g_(g),
      options_(std::move(options)),
      staged_(fetch_buffers > 0),
      actions_(actions),
      slots_(g.units.size()) {
  for (size_t b = fetch_buffers; b-- > 0;) free_fetch_buffers_.push_back(static_cast<int>(b));
}

uint64_t ResidencyPolicy::slab_bytes(int unit) const {
  return device::charged_bytes(g_.units[unit].padded * g_.param_bytes);
}

bool ResidencyPolicy::needed_by(size_t i, int unit) const {
  const std::vector<int>& n = (*sched_)[i].needs;
  return std::find(n.begin(), n.end(), unit) != n.end();
}

void ResidencyPolicy::begin(const std::vector<PassStep>* sched) { sched_ = sched; }

void ResidencyPolicy::fetch(int unit) {
  if (staged_ && free_fetch_buffers_.empty()) {
    // Every fetch buffer is held by a prefetch in flight: wait for one (it stays resident).
    for (size_t u = 0; u < slots_.size(); ++u)
      if (slots_[u].fetch_buffer >= 0) {
        wait_ready(static_cast<int>(u));
        break;
      }
  }
  const int buffer = staged_ ? free_fetch_buffers_.back() : -1;
  actions_.start_fetch(unit, buffer);
  if (staged_) free_fetch_buffers_.pop_back();
  Slot& s = slots_[unit];
  s.state = State::kFetching;
  s.kept = false;
  s.fetch_buffer = buffer;
  live_bytes_ += slab_bytes(unit);
  live_numel_ += g_.units[unit].padded;
}

void ResidencyPolicy::wait_ready(int unit) {
  Slot& s = slots_[unit];
  if (s.state != State::kFetching) return;
  actions_.wait_fetched(unit);
  s.state = State::kReady;
  if (s.fetch_buffer >= 0) {
    free_fetch_buffers_.push_back(s.fetch_buffer);
    s.fetch_buffer = -1;
  }
}

void ResidencyPolicy::free_slab(int unit) {
  Slot& s = slots_[unit];
  if (s.state == State::kAbsent) return;
  wait_ready(unit);
  actions_.free_slab(unit);
  live_bytes_ -= slab_bytes(unit);
  live_numel_ -= g_.units[unit].padded;
  s.state = State::kAbsent;
  s.kept = false;
}

bool ResidencyPolicy::evict_one(size_t i) {
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

void ResidencyPolicy::prefetch(size_t i) {
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
      if (staged_ && free_fetch_buffers_.empty()) return;
      fetch(u);
      in_flight += n;
    }
  }
}

void ResidencyPolicy::acquire(size_t i) {
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

void ResidencyPolicy::release(size_t i) {
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

void ResidencyPolicy::end() {
  for (size_t u = 0; u < slots_.size(); ++u) {
    wait_ready(static_cast<int>(u));
    if (!options_.persistent[u]) free_slab(static_cast<int>(u));
  }
  sched_ = nullptr;
}

void ResidencyPolicy::drop_all() {
  for (size_t u = 0; u < slots_.size(); ++u) free_slab(static_cast<int>(u));
}

namespace {

// Counts fetches; moves nothing.
class CountingActions final : public ResidencyActions {
 public:
  explicit CountingActions(size_t units) : fetches(units, 0) {}
  void start_fetch(int unit, int) override { ++fetches[unit]; }
  void wait_fetched(int) override {}
  void free_slab(int) override {}
  std::vector<uint64_t> fetches;
};

}  // namespace

std::vector<uint64_t> fetches_per_step(const model::LlamaModel& model, const Geometry& g,
                                       const CoordinatorOptions& options, size_t fetch_buffers,
                                       int64_t micro_batches) {
  const std::vector<PassStep> sched = train_schedule(model);
  CountingActions counter(g.units.size());
  ResidencyPolicy policy(g, options, fetch_buffers, counter);
  for (int64_t k = 0; k < micro_batches; ++k) {
    policy.begin(&sched);
    for (size_t i = 0; i < sched.size(); ++i) {
      policy.acquire(i);
      policy.release(i);
    }
    policy.end();
  }
  policy.drop_all();
  return counter.fetches;
}

}  // namespace outcore::zero::detail
