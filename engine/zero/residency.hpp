// Internal to engine/zero: the stage-3 residency policy, i.e. every decision the parameter
// coordinator takes (which unit to fetch, prefetch, wait for, keep for reuse, evict or
// release) as pure bookkeeping over a known pass schedule. ParamCoordinator drives the device
// work from it; the planner runs the same policy with no device work to count the fetches of
// one optimizer step, so the planned traffic is the traffic the engine produces.
//
// Threading: not thread-safe; one driving thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <set>
#include <utility>
#include <vector>

#include "engine/config/config.hpp"
#include "engine/zero/geometry.hpp"

namespace outcore::zero::detail {

struct CoordinatorOptions {
  uint64_t budget_bytes = 0;           // device bytes (charged) for gathered slabs
  uint64_t max_live_numel = 0;         // stage3_max_live_parameters
  uint64_t prefetch_bucket_numel = 0;  // stage3_prefetch_bucket_size (0: no prefetch)
  uint64_t max_reuse_distance = 0;     // stage3_max_reuse_distance
  std::vector<bool> persistent;        // per unit (stage3_param_persistence_threshold)
};

// The options the engine runs its coordinator with: `budget_bytes` is the plan's
// device_live_param_bytes, the rest comes from cfg.zero_optimization.
CoordinatorOptions coordinator_options(const config::Config& cfg, const Geometry& g,
                                       uint64_t budget_bytes);

// What the policy asks its owner to do. Each call may throw; the policy's bookkeeping then
// stays as before the call.
class ResidencyActions {
 public:
  virtual ~ResidencyActions() = default;
  // Start gathering `unit`'s slab; `fetch_buffer` is the staging buffer index it holds until
  // wait_fetched (-1 when the home needs none).
  virtual void start_fetch(int unit, int fetch_buffer) = 0;
  // Block until `unit`'s fetch (started, not yet waited for) completed.
  virtual void wait_fetched(int unit) = 0;
  // Free `unit`'s slab (fetched and waited for).
  virtual void free_slab(int unit) = 0;
};

class ResidencyPolicy {
 public:
  // `fetch_buffers`: staging buffers shared by the fetches of units whose parameters live in
  // swap files (g.placement.param_home); other homes need none. InvalidArgument when some
  // unit lives in a swap file and there are none. `actions` must outlive the policy.
  ResidencyPolicy(const Geometry& g, CoordinatorOptions options, size_t fetch_buffers,
                  ResidencyActions& actions);

  // Starts a pass over `sched` (which must outlive the pass).
  void begin(const std::vector<PassStep>* sched);
  // Makes every unit step `i` needs resident (evicting units kept for reuse while over the
  // budget, then fetching what is missing, then prefetching ahead), and waits for them.
  void acquire(size_t i);
  // After step i: releases its units unless persistent or kept for reuse.
  void release(size_t i);
  // Ends the pass: waits for stray prefetches, keeps for the next pass the units whose first
  // use there comes within max_reuse_distance elements (the next pass taken to run the same
  // schedule; nearest first, within the live cap and the budget) and releases the other
  // non-persistent slabs. The parameters must not change before the next begin() unless
  // drop_all() runs (the optimizer step drops every slab).
  void end();
  // Releases everything (the partitions changed).
  void drop_all();

  bool ready(int unit) const { return slots_.at(unit).state == State::kReady; }
  uint64_t live_bytes() const { return live_bytes_; }

 private:
  enum class State : uint8_t { kAbsent, kFetching, kReady };
  struct Slot {
    State state = State::kAbsent;
    bool kept = false;  // released but kept for reuse: evictable
    int fetch_buffer = -1;
  };

  bool staged(int unit) const;  // its fetch needs a staging buffer (its home is a swap file)
  void fetch(int unit);
  void prefetch(size_t i);
  void wait_ready(int unit);
  void free_slab(int unit);
  // Frees the kept unit needed farthest ahead if it is needed only after step i.
  bool evict_one(size_t i);
  bool needed_by(size_t i, int unit) const;
  uint64_t slab_bytes(int unit) const;
  // The first step after `i` that needs `unit`, or the schedule's size (O(log uses)).
  size_t next_use(size_t i, int unit) const;
  // After step i, whether `unit` stays gathered: its next use comes before max_reuse_distance
  // elements of other units are needed (DeepSpeed's stage3_max_reuse_distance).
  bool keep_for_reuse(size_t i, int unit) const;
  // The elements of other units needed after step i before `unit`'s next use: in this pass, or
  // else in the next one, taken to run the same schedule (UINT64_MAX when this pass does not
  // use the unit).
  uint64_t reuse_distance(size_t i, int unit) const;
  // Evicts kept units needed after step j (farthest first) until `numel` more elements and
  // `bytes` more bytes fit the live cap and the budget; false when they cannot.
  bool make_room(uint64_t numel, uint64_t bytes, size_t j);
  // Bookkeeping that keeps every decision O(log units) instead of a scan of all units or all
  // steps, so a pass is linear in the number of layers (up to a log).
  void set_kept(int unit, bool kept, size_t i);
  void became_absent(int unit, bool absent);

  const Geometry& g_;
  CoordinatorOptions options_;
  std::vector<int> free_fetch_buffers_;
  ResidencyActions& actions_;
  const std::vector<PassStep>* sched_ = nullptr;
  std::vector<Slot> slots_;
  uint64_t live_bytes_ = 0;
  uint64_t live_numel_ = 0;
  uint64_t fetching_numel_ = 0;  // units in State::kFetching
  // Per pass (begin): the steps needing each unit, the needed numel before each step, and per
  // step how many of its units are absent (steps with any in `steps_with_absent_`).
  std::vector<std::vector<size_t>> uses_;
  std::vector<uint64_t> numel_before_;
  std::vector<uint32_t> absent_needs_;
  std::set<size_t> steps_with_absent_;
  // Kept (evictable) units by (next use, -unit): the last is the eviction victim.
  std::set<std::pair<size_t, int>> kept_;
  std::vector<size_t> kept_key_;  // next use each kept unit was filed under
  std::set<int> holding_buffer_;  // units holding a fetch buffer
};

// Fetches of each unit over one optimizer step (gradient_accumulation_steps training passes,
// then the step, which drops every slab) from a cold start, under `options` and
// `fetch_buffers` as ResidencyPolicy takes them.
std::vector<uint64_t> fetches_per_step(const model::LlamaModel& model, const Geometry& g,
                                       const CoordinatorOptions& options, size_t fetch_buffers,
                                       int64_t micro_batches);

}  // namespace outcore::zero::detail
