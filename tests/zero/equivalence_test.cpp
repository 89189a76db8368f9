// Every stage and every placement trains bit-identically to stage 0 in memory.
#include <gtest/gtest.h>

#include "tests/zero/zero_test_util.hpp"

namespace outcore::zero::test {
namespace {

constexpr int kSteps = 20;

struct Case {
  DType dtype;
  bool tied;
};

class Equivalence : public ::testing::TestWithParam<Case> {};

TEST_P(Equivalence, EveryPlacementMatchesStage0InMemory) {
  const Case c = GetParam();
  const model::LlamaModel model(tiny_config(c.tied), tiny_options(c.dtype));
  const std::string tag = std::string(dtype_name(c.dtype)) + (c.tied ? "_tied" : "_untied");
  const RunResult ref = train(make_config(config_json({0}, c.dtype, "")), model, kSteps);
  // The baseline itself trains: finite, falling loss.
  ASSERT_TRUE(std::isfinite(ref.losses.back()));
  EXPECT_LT(ref.losses.back(), ref.losses.front());

  const std::vector<Placing> setups = {
      {1, "none", "none"}, {2, "none", "none"}, {3, "none", "none"}, {1, "none", "cpu"},
      {2, "none", "cpu"},  {3, "cpu", "cpu"},   {3, "nvme", "nvme"}, {3, "none", "nvme"},
      {2, "none", "nvme"},  // kept in host memory below stage 3
  };
  for (const Placing& s : setups) {
    SCOPED_TRACE(s.name());
    const std::string dir = swap_dir(tag + "_" + s.name()).string();
    const RunResult r = train(make_config(config_json(s, c.dtype, dir)), model, kSteps);
    expect_bit_identical(ref, r, s.name());
    if (s.stage == 3 && (s.offload_param == "nvme" || s.offload_optimizer == "nvme")) {
      EXPECT_GT(r.traffic.nvme_read_bytes, 0u);
      EXPECT_GT(r.traffic.nvme_write_bytes, 0u);
    }
  }
  // Gradient accumulators in swap files too.
  for (const Placing& s : {Placing{3, "nvme", "nvme"}, Placing{3, "cpu", "nvme"}}) {
    SCOPED_TRACE(s.name() + " + nvme gradients");
    const std::string dir = swap_dir(tag + "_" + s.name() + "_grads").string();
    const RunResult r =
        train(make_config(config_json(s, c.dtype, dir)), model, kSteps, 0, nvme_gradients());
    EXPECT_EQ(r.plan.placement.gradients, Tier::kNvme);
    expect_bit_identical(ref, r, s.name() + " + nvme gradients");
  }
}

INSTANTIATE_TEST_SUITE_P(Zero, Equivalence,
                         ::testing::Values(Case{DType::F32, false}, Case{DType::BF16, true},
                                           Case{DType::BF16, false}),
                         [](const auto& info) {
                           return std::string(dtype_name(info.param.dtype)) +
                                  (info.param.tied ? "_tied" : "_untied");
                         });

}  // namespace
}  // namespace outcore::zero::test
