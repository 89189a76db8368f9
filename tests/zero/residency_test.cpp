// The stage-3 residency policy's prefetch rule, checked on the order of the actions it asks for
// (the engine and the planner both follow these decisions).
#include "engine/zero/residency.hpp"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "engine/zero/geometry.hpp"
#include "tests/zero/zero_test_util.hpp"

namespace outcore::zero::test {
namespace {

// Records the policy's requests as "fetch u" / "wait u" / "free u".
struct Recorder final : detail::ResidencyActions {
  std::vector<std::string> log;
  void start_fetch(int unit, int) override { log.push_back("fetch " + std::to_string(unit)); }
  void wait_fetched(int unit) override { log.push_back("wait " + std::to_string(unit)); }
  void free_slab(int unit) override { log.push_back("free " + std::to_string(unit)); }
};

class Residency : public ::testing::Test {
 protected:
  Residency()
      : model_(tiny_config(false), tiny_options(DType::BF16)),
        cfg_(make_config(config_json({3, "nvme", "nvme"}, DType::BF16, "/nonexistent"))),
        g_(detail::make_geometry(cfg_, model_, {.world = 1, .rank = 0})),
        sched_(detail::train_schedule(model_)) {}

  // The actions of acquire(0) on a cold start, with every unit streamed, plenty of memory and
  // fetch buffers, and `bucket` elements of prefetch.
  std::vector<std::string> first_acquire(uint64_t bucket) {
    detail::CoordinatorOptions o;
    o.budget_bytes = uint64_t{1} << 40;
    o.max_live_numel = uint64_t{1} << 40;
    o.prefetch_bucket_numel = bucket;
    o.persistent.assign(g_.units.size(), false);
    Recorder r;
    detail::ResidencyPolicy p(g_, o, 8, r);
    p.begin(&sched_);
    p.acquire(0);
    return r.log;
  }

  uint64_t numel(int unit) const { return g_.units.at(unit).padded; }

  // Fetches per unit over `passes` training passes of one step, no prefetch, plenty of memory.
  std::vector<int> fetches(int passes, uint64_t reuse, uint64_t live) {
    detail::CoordinatorOptions o;
    o.budget_bytes = uint64_t{1} << 40;
    o.max_live_numel = live;
    o.max_reuse_distance = reuse;
    o.persistent.assign(g_.units.size(), false);
    Recorder r;
    detail::ResidencyPolicy p(g_, o, 8, r);
    for (int k = 0; k < passes; ++k) {
      p.begin(&sched_);
      for (size_t i = 0; i < sched_.size(); ++i) {
        p.acquire(i);
        p.release(i);
      }
      p.end();
    }
    std::vector<int> n(g_.units.size(), 0);
    for (const std::string& line : r.log)
      if (line.rfind("fetch ", 0) == 0) ++n.at(std::stoi(line.substr(6)));
    return n;
  }

  model::LlamaModel model_;
  config::Config cfg_;
  detail::Geometry g_;
  std::vector<detail::PassStep> sched_;
};

TEST_F(Residency, NoBucketMeansNoPrefetch) {
  EXPECT_EQ(first_acquire(0), (std::vector<std::string>{"fetch 0", "wait 0"}));
}

// DeepSpeed's rule: the step's own units do not count, and a unit is fetched ahead while less
// than the bucket is in flight ahead, so the next unit is prefetched even when it is larger
// than the bucket.
TEST_F(Residency, OneUnitAheadEvenWhenLargerThanTheBucket) {
  ASSERT_GT(numel(1), 1u);
  EXPECT_EQ(first_acquire(1), (std::vector<std::string>{"fetch 0", "fetch 1", "wait 0"}));
  EXPECT_EQ(first_acquire(numel(1)), (std::vector<std::string>{"fetch 0", "fetch 1", "wait 0"}));
}

TEST_F(Residency, PrefetchStopsOnceTheBucketIsReached) {
  EXPECT_EQ(first_acquire(numel(1) + 1),
            (std::vector<std::string>{"fetch 0", "fetch 1", "fetch 2", "wait 0"}));
  EXPECT_EQ(first_acquire(numel(1) + numel(2) + 1),
            (std::vector<std::string>{"fetch 0", "fetch 1", "fetch 2", "fetch 3", "wait 0"}));
}

// The parameters do not change between the micro-batches of a step: with room for every unit
// and a reuse distance longer than a pass, each unit is gathered once per step, not once per
// pass. With no reuse, every pass gathers each unit twice (forward and backward).
TEST_F(Residency, UnitsStayGatheredAcrossThePassesOfAStep) {
  const int units = static_cast<int>(g_.units.size());
  const uint64_t all = uint64_t{1} << 40;
  EXPECT_EQ(fetches(3, all, all), std::vector<int>(units, 1));
  std::vector<int> streamed(units, 6);
  streamed.front() = 3;  // the embedding's backward reads no parameters
  streamed.back() = 3;   // the head: its loss and backward are one step of the pass
  EXPECT_EQ(fetches(3, 0, all), streamed);
}

// Under the live cap, the units kept for the next pass are those it needs first: the
// embedding and the first layer stay, the rest is gathered again.
TEST_F(Residency, TheUnitsKeptForTheNextPassAreTheNearestWithinTheLiveCap) {
  const int units = static_cast<int>(g_.units.size());
  ASSERT_GE(units, 4);
  const uint64_t all = uint64_t{1} << 40;
  // Within a pass every unit stays (the cap allows all), so only what end() keeps differs.
  const std::vector<int> once = fetches(1, all, all);
  ASSERT_EQ(once, std::vector<int>(units, 1));
  const std::vector<int> two = fetches(2, all, numel(0) + numel(1));
  EXPECT_EQ(two[0], 1);
  EXPECT_EQ(two[1], 1);
  for (int u = 2; u < units; ++u) EXPECT_GT(two[u], 1) << "unit " << u;
}

}  // namespace
}  // namespace outcore::zero::test
