// Loss scaler: DeepSpeed's DynamicLossScaler.update_scale rule, step by step; the static
// and disabled scalers; state round trips; the unscale-and-clip coefficient.
#include "engine/train/loss_scaler.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "engine/zero/zero.hpp"

namespace outcore::train {
namespace {

LossScalerOptions dyn(int power, int64_t window, int64_t hysteresis, bool consecutive = false,
                      double min_scale = 1) {
  return {.loss_scale = 0,
          .initial_scale_power = power,
          .loss_scale_window = window,
          .hysteresis = hysteresis,
          .consecutive_hysteresis = consecutive,
          .min_loss_scale = min_scale};
}

// Feeds a pattern ('o' overflow, '.' clean) and returns the scale after each update.
std::vector<double> feed(LossScaler& s, std::string_view pattern) {
  std::vector<double> scales;
  for (char c : pattern) scales.push_back(s.update(c == 'o').scale_after);
  return scales;
}

TEST(LossScaler, StartsAtTwoToTheInitialPower) {
  LossScaler s(dyn(16, 1000, 2));
  EXPECT_TRUE(s.dynamic());
  EXPECT_EQ(s.scale(), 65536.0);
  EXPECT_EQ(s.hysteresis(), 2);
}

TEST(LossScaler, OverflowSkipsAndHalvesOnlyOnceHysteresisIsSpent) {
  LossScaler s(dyn(10, 1000, 2));
  LossScaleUpdate first = s.update(true);
  EXPECT_TRUE(first.overflow);
  EXPECT_EQ(first.scale_before, 1024.0);
  EXPECT_EQ(first.scale_after, 1024.0);  // hysteresis 2 -> 1, scale kept
  EXPECT_EQ(first.hysteresis_after, 1);
  EXPECT_NE(first.message.find("Reducing hysteresis to 1"), std::string::npos) << first.message;
  LossScaleUpdate second = s.update(true);
  EXPECT_EQ(second.scale_after, 512.0);
  EXPECT_NE(second.message.find("reducing to 512"), std::string::npos) << second.message;
  // Hysteresis is NOT refilled by halving: the next overflow halves again at once.
  EXPECT_EQ(s.update(true).scale_after, 256.0);
  EXPECT_EQ(s.hysteresis(), 1);
}

TEST(LossScaler, HysteresisOneHalvesOnEveryOverflow) {
  LossScaler s(dyn(4, 1000, 1));
  EXPECT_EQ(feed(s, "ooo"), (std::vector<double>{8, 4, 2}));
}

TEST(LossScaler, GrowsAfterEachWindowOfCleanSteps) {
  // Window 3, no overflow ever: last_overflow_iter = -1, stable = cur_iter; doubling when
  // cur_iter (before the increment) is a positive multiple of 3: iterations 3, 6, 9.
  LossScaler s(dyn(0, 3, 2));
  EXPECT_EQ(feed(s, ".........."), (std::vector<double>{1, 1, 1, 2, 2, 2, 4, 4, 4, 8}));
}

TEST(LossScaler, WindowCountsFromTheLastOverflowAndRefillsHysteresis) {
  LossScaler s(dyn(5, 2, 2));  // 32
  // iter 0: overflow (hysteresis 2 -> 1, scale 32); iter 1: overflow -> 16 (last overflow
  // 1); iters 2, 3, 4: stable = iter - 1 - 1 = 0, 1, 2 -> at 2 (= window) double to 32 and
  // refill hysteresis to 2.
  EXPECT_EQ(feed(s, "oo..."), (std::vector<double>{32, 16, 16, 16, 32}));
  EXPECT_EQ(s.hysteresis(), 2);
  // With hysteresis refilled, one overflow is tolerated again.
  EXPECT_EQ(s.update(true).scale_after, 32.0);
  EXPECT_EQ(s.update(true).scale_after, 16.0);
}

TEST(LossScaler, WithoutConsecutiveHysteresisACleanStepDoesNotRefill) {
  LossScaler s(dyn(6, 100, 3));  // 64, hysteresis 3
  feed(s, "o.o.");               // two overflows separated by clean steps
  EXPECT_EQ(s.hysteresis(), 1);
  EXPECT_EQ(s.scale(), 64.0);
  EXPECT_EQ(s.update(true).scale_after, 32.0);
}

TEST(LossScaler, ConsecutiveHysteresisRefillsOnEveryCleanStep) {
  LossScaler s(dyn(6, 100, 2, /*consecutive=*/true));
  // Overflow, clean (refill to 2), overflow, clean: hysteresis absorbs every overflow.
  EXPECT_EQ(feed(s, "o.o.o."), (std::vector<double>{64, 64, 64, 64, 64, 64}));
  EXPECT_EQ(s.hysteresis(), 2);
  // Two overflows in a row still halve.
  EXPECT_EQ(feed(s, "oo"), (std::vector<double>{64, 32}));
}

TEST(LossScaler, ScaleStopsAtTheMinimumThenOverflowThere) {
  LossScaler s(dyn(3, 1000, 1, false, /*min_scale=*/2));
  EXPECT_EQ(feed(s, "oo"), (std::vector<double>{4, 2}));
  EXPECT_THROW(s.update(true), LossScaleAtMinimum);
}

TEST(LossScaler, HalvingIsClampedToTheMinimum) {
  LossScaler s(dyn(2, 1000, 1, false, /*min_scale=*/3));  // 4 -> max(2, 3) = 3
  EXPECT_EQ(s.update(true).scale_after, 3.0);
  EXPECT_THROW(s.update(true), LossScaleAtMinimum);
}

TEST(LossScaler, NoErrorAtMinimumWhenDisabled) {
  LossScalerOptions o = dyn(1, 1000, 1);
  o.raise_error_at_min_scale = false;
  LossScaler s(o);
  EXPECT_EQ(feed(s, "ooo"), (std::vector<double>{1, 1, 1}));
}

TEST(LossScaler, StaticScaleNeverChanges) {
  LossScaler s(LossScalerOptions{.loss_scale = 128});
  EXPECT_FALSE(s.dynamic());
  LossScaleUpdate u = s.update(true);
  EXPECT_TRUE(u.overflow);
  EXPECT_EQ(u.scale_after, 128.0);
  EXPECT_EQ(feed(s, "...o"), (std::vector<double>{128, 128, 128, 128}));
}

TEST(LossScaler, DisabledScalerIsOne) {
  LossScaler s;
  EXPECT_EQ(s.scale(), 1.0);
  EXPECT_FALSE(s.dynamic());
  EXPECT_EQ(s.update(false).scale_after, 1.0);
}

TEST(LossScaler, InvalidOptionsNameTheKey) {
  auto path_of = [](LossScalerOptions o) -> std::string {
    try {
      LossScaler s(o);
    } catch (const ConfigError& e) {
      return e.json_path();
    }
    return "";
  };
  EXPECT_EQ(path_of(dyn(16, 0, 2)), "fp16.loss_scale_window");
  EXPECT_EQ(path_of(dyn(16, 10, 0)), "fp16.hysteresis");
  EXPECT_EQ(path_of(dyn(16, 10, 2, false, 0)), "fp16.min_loss_scale");
  EXPECT_EQ(path_of(dyn(-1, 10, 2)), "fp16.initial_scale_power");
  EXPECT_EQ(path_of({.loss_scale = -1}), "fp16.loss_scale");
  EXPECT_EQ(path_of({.loss_scale = std::numeric_limits<double>::infinity()}), "fp16.loss_scale");
}

TEST(LossScaler, StateRoundTripContinuesIdentically) {
  LossScalerOptions o = dyn(8, 3, 2);
  LossScaler a(o);
  feed(a, "o..o.");
  LossScaler b(o);
  b.load_state_json(a.state_json());
  EXPECT_EQ(a.state(), b.state());
  EXPECT_EQ(feed(a, "...o..o....oo"), feed(b, "...o..o....oo"));
}

TEST(LossScaler, BadStateIsRejected) {
  LossScaler s(dyn(8, 3, 2));
  EXPECT_THROW(
      s.load_state({.cur_scale = 0, .cur_iter = 1, .last_overflow_iter = -1, .cur_hysteresis = 1}),
      InvalidArgument);
  EXPECT_THROW(
      s.load_state({.cur_scale = 4, .cur_iter = 1, .last_overflow_iter = 1, .cur_hysteresis = 1}),
      InvalidArgument);
  EXPECT_THROW(
      s.load_state({.cur_scale = 4, .cur_iter = 1, .last_overflow_iter = -1, .cur_hysteresis = 0}),
      InvalidArgument);
  // More hysteresis left than the config's fp16.hysteresis (lowered for the resumed run): the
  // config's.
  s.load_state({.cur_scale = 4, .cur_iter = 1, .last_overflow_iter = -1, .cur_hysteresis = 3});
  EXPECT_EQ(s.state().cur_hysteresis, 2);
  nlohmann::json j = s.state_json();
  j["dynamic"] = false;  // an fp32 run's checkpoint resumed with fp16's dynamic scaling
  try {
    s.load_state_json(j);
    ADD_FAILURE() << "a static scaler's state was taken by a dynamic one";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("saved with a static loss scale (fp16 off, or "
                                         "fp16.loss_scale > 0), this config asks for dynamic"),
              std::string::npos)
        << e.what();
  }
  j = s.state_json();
  j.erase("cur_iter");
  EXPECT_THROW(s.load_state_json(j), InvalidArgument);
}

TEST(UnscaleAndClip, NoClippingBelowTheThresholdOnlyUnscales) {
  // Unscaled norm 0.5 with clip 1: c = max(1, (0.5 + 1e-6) / 1) = 1.
  EXPECT_DOUBLE_EQ(zero::unscale_and_clip_multiplier(0.5, 1024, 1.0), 1.0 / 1024);
}

TEST(UnscaleAndClip, ClipsToTheThresholdInTheSameMultiply) {
  // Unscaled norm 4, clip 1: c = 4 + 1e-6; the clipped gradient norm is 4 / (4 + 1e-6).
  double total = 4.0 * 256;
  double k = zero::unscale_and_clip_multiplier(total / 256, 256, 1.0);
  EXPECT_DOUBLE_EQ(k, 1.0 / ((4.0 + 1e-6) * 256));
  EXPECT_NEAR(total * k, 1.0, 1e-6);
}

TEST(UnscaleAndClip, ClipZeroMeansOff) {
  EXPECT_DOUBLE_EQ(zero::unscale_and_clip_multiplier(1e9 / 8, 8, 0.0), 1.0 / 8);
}

TEST(UnscaleAndClip, NonFiniteNormDoesNotClip) {
  EXPECT_DOUBLE_EQ(zero::unscale_and_clip_multiplier(std::nan(""), 4, 1.0), 0.25);
  EXPECT_DOUBLE_EQ(zero::unscale_and_clip_multiplier(INFINITY, 4, 1.0), 0.25);
}

TEST(UnscaleAndClip, BadArgumentsThrow) {
  EXPECT_THROW(zero::unscale_and_clip_multiplier(1, 0, 1), InvalidArgument);
  EXPECT_THROW(zero::unscale_and_clip_multiplier(1, 1, -1), InvalidArgument);
  EXPECT_THROW(zero::unscale_and_clip_multiplier(1, 1, 1, 0), InvalidArgument);
}

}  // namespace
}  // namespace outcore::train
