#include "engine/zero/residency.hpp"

#include <algorithm>

#include "common/error.hpp"
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
      actions_(actions),
      slots_(g.units.size()),
      kept_key_(g.units.size(), 0) {
  if (g.placement.nvme_param_units > 0 && fetch_buffers == 0)
    throw InvalidArgument("zero: parameters in swap files need at least one fetch buffer");
  for (size_t b = fetch_buffers; b-- > 0;) free_fetch_buffers_.push_back(static_cast<int>(b));
}

bool ResidencyPolicy::staged(int unit) const {
  return g_.placement.param_home(static_cast<size_t>(unit)) == Tier::kNvme;
}

uint64_t ResidencyPolicy::slab_bytes(int unit) const {
  return device::charged_bytes(g_.units[unit].padded * g_.param_bytes);
}

bool ResidencyPolicy::needed_by(size_t i, int unit) const {
  const std::vector<int>& n = (*sched_)[i].needs;
  return std::find(n.begin(), n.end(), unit) != n.end();
}

void ResidencyPolicy::begin(const std::vector<PassStep>* sched) {
  sched_ = sched;
  const size_t steps = sched->size();
  uses_.assign(slots_.size(), {});
  numel_before_.assign(steps + 1, 0);
  absent_needs_.assign(steps, 0);
  steps_with_absent_.clear();
  for (size_t j = 0; j < steps; ++j) {
    uint64_t numel = 0;
    for (int u : (*sched)[j].needs) {
      uses_[u].push_back(j);
      numel += g_.units[u].padded;
      if (slots_[u].state == State::kAbsent) ++absent_needs_[j];
    }
    numel_before_[j + 1] = numel_before_[j] + numel;
    if (absent_needs_[j] > 0) steps_with_absent_.insert(j);
  }
  // Units kept across passes are filed under their next use in this pass.
  kept_.clear();
  for (size_t u = 0; u < slots_.size(); ++u) {
    if (!slots_[u].kept) continue;
    kept_key_[u] = uses_[u].empty() ? steps : uses_[u].front();
    kept_.insert({kept_key_[u], -static_cast<int>(u)});
  }
}

size_t ResidencyPolicy::next_use(size_t i, int unit) const {
  const std::vector<size_t>& u = uses_[unit];
  const auto it = std::upper_bound(u.begin(), u.end(), i);
  return it == u.end() ? sched_->size() : *it;
}

uint64_t ResidencyPolicy::reuse_distance(size_t i, int unit) const {
  const size_t j = next_use(i, unit);
  // Steps i+1 .. j-1 do not need `unit` (j is its next use): all their numel is others'.
  if (j < sched_->size()) return numel_before_[j] - numel_before_[i + 1];
  // No later use in this pass: the rest of it, then the next pass up to its first use.
  const std::vector<size_t>& u = uses_[unit];
  if (u.empty()) return UINT64_MAX;
  return numel_before_[sched_->size()] - numel_before_[i + 1] + numel_before_[u.front()];
}

bool ResidencyPolicy::keep_for_reuse(size_t i, int unit) const {
  return reuse_distance(i, unit) < options_.max_reuse_distance;
}

void ResidencyPolicy::set_kept(int unit, bool kept, size_t i) {
  Slot& s = slots_[unit];
  if (s.kept == kept) return;
  if (s.kept) kept_.erase({kept_key_[unit], -unit});
  s.kept = kept;
  if (!kept) return;
  kept_key_[unit] = next_use(i, unit);
  kept_.insert({kept_key_[unit], -unit});
}

void ResidencyPolicy::became_absent(int unit, bool absent) {
  if (sched_ == nullptr) return;  // rebuilt by the next begin()
  for (size_t j : uses_[unit]) {
    if (absent) {
      if (absent_needs_[j]++ == 0) steps_with_absent_.insert(j);
    } else if (--absent_needs_[j] == 0) {
      steps_with_absent_.erase(j);
    }
  }
}

void ResidencyPolicy::fetch(int unit) {
  const bool needs_buffer = staged(unit);
  if (needs_buffer && free_fetch_buffers_.empty()) {
    // Every fetch buffer is held by a prefetch in flight: wait for one (it stays resident).
    if (!holding_buffer_.empty()) wait_ready(*holding_buffer_.begin());
  }
  const int buffer = needs_buffer ? free_fetch_buffers_.back() : -1;
  actions_.start_fetch(unit, buffer);
  if (needs_buffer) free_fetch_buffers_.pop_back();
  set_kept(unit, false, 0);
  Slot& s = slots_[unit];
  s.state = State::kFetching;
  s.fetch_buffer = buffer;
  if (buffer >= 0) holding_buffer_.insert(unit);
  live_bytes_ += slab_bytes(unit);
  live_numel_ += g_.units[unit].padded;
  fetching_numel_ += g_.units[unit].padded;
  became_absent(unit, false);
}

void ResidencyPolicy::wait_ready(int unit) {
  Slot& s = slots_[unit];
  if (s.state != State::kFetching) return;
  actions_.wait_fetched(unit);
  s.state = State::kReady;
  fetching_numel_ -= g_.units[unit].padded;
  if (s.fetch_buffer >= 0) {
    free_fetch_buffers_.push_back(s.fetch_buffer);
    holding_buffer_.erase(unit);
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
  set_kept(unit, false, 0);
  became_absent(unit, true);
}

bool ResidencyPolicy::evict_one(size_t i) {
  // The kept unit whose next use is farthest (lowest index among ties), if that use comes
  // after step i: the units steps up to i need stay.
  if (kept_.empty()) return false;
  const auto [next, neg_unit] = *kept_.rbegin();
  if (next <= i) return false;
  free_slab(-neg_unit);
  return true;
}

bool ResidencyPolicy::make_room(uint64_t numel, uint64_t bytes, size_t j) {
  while (live_numel_ + numel > options_.max_live_numel ||
         live_bytes_ + bytes > options_.budget_bytes)
    if (!evict_one(j)) return false;
  return true;
}

void ResidencyPolicy::prefetch(size_t i) {
  if (options_.prefetch_bucket_numel == 0) return;
  // DeepSpeed's rule: the elements fetched ahead of step i (its own units do not count) may
  // reach the bucket with the last unit started, so one unit is always fetched ahead, even a
  // unit larger than the bucket (with a 50M bucket and 200M-element layers nothing would
  // otherwise overlap the drive with compute).
  uint64_t in_flight = fetching_numel_;
  for (int u : (*sched_)[i].needs)
    if (slots_[u].state == State::kFetching) in_flight -= g_.units[u].padded;
  // Only steps with an absent unit can start a fetch, and each one visited is either fetched
  // whole or ends the prefetch: the walk costs the fetches it starts, not the schedule.
  for (size_t after = i;;) {
    const auto it = steps_with_absent_.upper_bound(after);
    if (it == steps_with_absent_.end()) return;
    const size_t j = *it;
    for (int u : (*sched_)[j].needs) {
      if (slots_[u].state != State::kAbsent) continue;
      const uint64_t n = g_.units[u].padded;
      if (in_flight >= options_.prefetch_bucket_numel) return;
      if (!make_room(n, slab_bytes(u), j)) return;
      if (staged(u) && free_fetch_buffers_.empty()) return;
      fetch(u);
      in_flight += n;
    }
    after = j;
  }
}

void ResidencyPolicy::acquire(size_t i) {
  for (int u : (*sched_)[i].needs) {
    set_kept(u, false, i);
    if (slots_[u].state != State::kAbsent) continue;
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
    if (keep_for_reuse(i, u) && live_numel_ <= options_.max_live_numel) {
      set_kept(u, true, i);
      continue;
    }
    free_slab(u);
  }
}

void ResidencyPolicy::end() {
  // The parameters do not change between the passes of one optimizer step (the step drops
  // every slab first): a unit whose first use in the next pass, taken to follow the same
  // schedule, comes within max_reuse_distance elements stays gathered, as within a pass,
  // nearest first while the live cap and the budget allow; it stays evictable.
  std::vector<std::pair<uint64_t, int>> keep;
  for (size_t u = 0; u < slots_.size(); ++u) {
    const int unit = static_cast<int>(u);
    wait_ready(unit);
    if (options_.persistent[u] || slots_[u].state == State::kAbsent) continue;
    const std::vector<size_t>& uses = uses_[u];
    const uint64_t d = uses.empty() ? UINT64_MAX : reuse_distance(uses.back(), unit);
    if (d < options_.max_reuse_distance)
      keep.emplace_back(d, unit);
    else
      free_slab(unit);
  }
  std::sort(keep.begin(), keep.end());
  while (!keep.empty() &&
         (live_numel_ > options_.max_live_numel || live_bytes_ > options_.budget_bytes)) {
    free_slab(keep.back().second);
    keep.pop_back();
  }
  for (const auto& [d, unit] : keep) set_kept(unit, true, 0);
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
