// DeepSpeed's batch arithmetic: train_batch_size = micro x gas x world size, every direction.
#include <gtest/gtest.h>

#include "tests/config/config_test_util.hpp"

namespace outcore::config {
namespace {

using testing::dump;
using testing::errors_of;
using testing::has_issue;

// A given batch key, unset (0) or "auto" (-1).
constexpr int64_t kUnset = 0;
constexpr int64_t kAuto = -1;

void put(AutoOr<int64_t>& key, int64_t v) {
  if (v == kAuto) {
    key.set_auto();
  } else if (v != kUnset) {
    key.set(v);
  }
}

Config batch(int64_t b, int64_t m, int64_t g) {
  Config c;
  put(c.train_batch_size, b);
  put(c.train_micro_batch_size_per_gpu, m);
  put(c.gradient_accumulation_steps, g);
  return c;
}

struct Case {
  const char* name;
  int64_t batch, micro, gas, world;
  int64_t want_batch, want_micro, want_gas;
};

class BatchInference : public ::testing::TestWithParam<Case> {};

TEST_P(BatchInference, InfersTheMissingKeys) {
  const Case& k = GetParam();
  Config c = batch(k.batch, k.micro, k.gas);
  resolve_batch_sizes(c, k.world);
  EXPECT_EQ(c.train_batch_size.value(), k.want_batch);
  EXPECT_EQ(c.train_micro_batch_size_per_gpu.value(), k.want_micro);
  EXPECT_EQ(c.gradient_accumulation_steps.value(), k.want_gas);
  EXPECT_EQ(c.train_batch_size.value(), c.train_micro_batch_size_per_gpu.value() *
                                            c.gradient_accumulation_steps.value() * k.world);
}

INSTANTIATE_TEST_SUITE_P(
    AllDirections, BatchInference,
    ::testing::Values(Case{"all_three_world1", 32, 4, 8, 1, 32, 4, 8},
                      Case{"all_three_world4", 32, 4, 2, 4, 32, 4, 2},
                      Case{"batch_micro_world1", 32, 4, kUnset, 1, 32, 4, 8},
                      Case{"batch_micro_world2", 32, 4, kUnset, 2, 32, 4, 4},
                      Case{"batch_gas_world1", 32, kUnset, 4, 1, 32, 8, 4},
                      Case{"batch_gas_world4", 32, kUnset, 2, 4, 32, 4, 2},
                      Case{"micro_gas_world1", kUnset, 4, 2, 1, 8, 4, 2},
                      Case{"micro_gas_world3", kUnset, 4, 2, 3, 24, 4, 2},
                      Case{"batch_only_world1", 32, kUnset, kUnset, 1, 32, 32, 1},
                      Case{"batch_only_world4", 32, kUnset, kUnset, 4, 32, 8, 1},
                      Case{"micro_only_world1", kUnset, 4, kUnset, 1, 4, 4, 1},
                      Case{"micro_only_world8", kUnset, 4, kUnset, 8, 32, 4, 1},
                      // "auto" without a value to fill it counts as not given.
                      Case{"auto_batch", kAuto, 4, 2, 2, 16, 4, 2},
                      Case{"auto_gas", 32, 4, kAuto, 2, 32, 4, 4},
                      Case{"auto_micro_and_gas", 32, kAuto, kAuto, 4, 32, 8, 1}),
    [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

TEST(BatchArithmetic, MismatchShowsTheArithmetic) {
  Config c = batch(32, 4, 2);
  auto issues = errors_of([&] { resolve_batch_sizes(c, 2); });
  ASSERT_EQ(issues.size(), 1u);
  EXPECT_EQ(issues[0].json_path, "train_batch_size");
  EXPECT_NE(issues[0].message.find("train_batch_size 32 != micro 4 x gas 2 x world 2 = 16"),
            std::string::npos)
      << dump(issues);
  // The same three values are consistent at world size 4.
  Config ok = batch(32, 4, 2);
  EXPECT_NO_THROW(resolve_batch_sizes(ok, 4));
}

TEST(BatchArithmetic, RemainderIsAnError) {
  Config a = batch(30, 4, kUnset);
  EXPECT_TRUE(has_issue(errors_of([&] { resolve_batch_sizes(a, 2); }),
                        "gradient_accumulation_steps",
                        "train_batch_size 30 is not a multiple of micro 4 x world 2"));
  Config b = batch(30, kUnset, 4);
  EXPECT_TRUE(has_issue(errors_of([&] { resolve_batch_sizes(b, 1); }),
                        "train_micro_batch_size_per_gpu",
                        "train_batch_size 30 is not a multiple of gas 4 x world 1"));
  Config c = batch(30, kUnset, kUnset);
  EXPECT_TRUE(has_issue(errors_of([&] { resolve_batch_sizes(c, 4); }),
                        "train_micro_batch_size_per_gpu",
                        "train_batch_size 30 is not a multiple of world 4"));
  Config d = batch(2, 4, kUnset);  // smaller than one micro batch
  EXPECT_FALSE(errors_of([&] { resolve_batch_sizes(d, 1); }).empty());
}

TEST(BatchArithmetic, NeitherBatchNorMicroIsAnError) {
  for (int64_t gas : {kUnset, int64_t{4}}) {
    Config c = batch(kUnset, kUnset, gas);
    auto issues = errors_of([&] { resolve_batch_sizes(c, 1); });
    EXPECT_TRUE(has_issue(issues, "train_batch_size",
                          "give train_batch_size or train_micro_batch_size_per_gpu"))
        << dump(issues);
  }
}

TEST(BatchArithmetic, UnresolvableAutoStaysAuto) {
  Config c = batch(kAuto, kAuto, kAuto);
  EXPECT_NO_THROW(resolve_batch_sizes(c, 2));
  EXPECT_TRUE(c.train_batch_size.is_auto());
  EXPECT_TRUE(c.train_micro_batch_size_per_gpu.is_auto());
  EXPECT_TRUE(c.gradient_accumulation_steps.is_auto());
  EXPECT_THROW(c.train_batch_size.value(), ConfigError);
}

TEST(BatchArithmetic, BadWorldSizeAndOverflow) {
  Config c = batch(8, kUnset, kUnset);
  EXPECT_FALSE(errors_of([&] { resolve_batch_sizes(c, 0); }).empty());
  Config big = batch(kUnset, kMaxMicroBatch, int64_t{1} << 40);
  EXPECT_TRUE(has_issue(errors_of([&] { resolve_batch_sizes(big, 1 << 10); }), "train_batch_size",
                        "overflows"));
}

// A world size past kMaxWorldSize (2^32 + 2 once became 2 in an int) and a micro batch inferred
// past kMaxMicroBatch are refused, not planned.
TEST(BatchArithmetic, WorldSizeAndInferredMicroBatchHaveUpperBounds) {
  Config c = batch(8, kUnset, kUnset);
  EXPECT_TRUE(has_issue(errors_of([&] { resolve_batch_sizes(c, (int64_t{1} << 32) + 2); }), "",
                        "the world size is 4294967298; allowed: an integer in 1..1048576"));
  Config edge = batch(kMaxWorldSize, kUnset, kUnset);
  EXPECT_NO_THROW(resolve_batch_sizes(edge, kMaxWorldSize));
  Config huge = batch(int64_t{1} << 40, kUnset, 1);
  EXPECT_TRUE(has_issue(errors_of([&] { resolve_batch_sizes(huge, 1); }),
                        "train_micro_batch_size_per_gpu",
                        "is 1099511627776; allowed: at most 1048576 sequences per micro-batch"));
  AutoContext ctx;
  ctx.world_size = (int64_t{1} << 32) + 2;
  ctx.micro_batch_size = kMaxMicroBatch + 1;
  Config a = batch(kAuto, kAuto, 1);
  const auto issues = errors_of([&] { resolve_auto(a, ctx); });
  EXPECT_TRUE(has_issue(issues, "", "the world size is 4294967298")) << dump(issues);
  EXPECT_TRUE(has_issue(issues, "", "the micro batch size is 1048577")) << dump(issues);
}

TEST(BatchArithmetic, FromTextThroughResolveAuto) {
  ParsedConfig p = parse_config(R"({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2})");
  AutoContext ctx;
  ctx.world_size = 8;
  resolve_auto(p.config, ctx);
  EXPECT_EQ(p.config.gradient_accumulation_steps.value(), 4);
  EXPECT_NO_THROW(require_resolved(p.config));
}

}  // namespace
}  // namespace outcore::config
