// LR schedules: DeepSpeed's formulas and stepping, against hand-computed values and against
// tests/train/oracle/lr_reference.py (an independent implementation from the reference text).
#include "engine/train/lr_schedule.hpp"

#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "tests/common/log_capture.hpp"
#include "tests/common/oracle_unavailable.hpp"

namespace outcore::train {
namespace {

using nlohmann::json;

// The lr each optimizer step 1..steps uses, stepping the schedule as the engine does:
// after every step not in `skip`.
std::vector<double> run_steps(LrSchedule& s, int steps, const std::set<int>& skip = {}) {
  std::vector<double> lrs;
  for (int k = 1; k <= steps; ++k) {
    lrs.push_back(s.lr());
    if (!skip.contains(k)) s.step();
  }
  return lrs;
}

TEST(LrSchedule, FirstStepUsesLrOfIndexMinusOneAndSecondStepIndexZero) {
  // WarmupLR linear, 4 warmup steps, 0 -> 1: lr(i) = i/4 for 0 <= i < 4, lr(-1) = 0.
  auto s = make_warmup_lr({.warmup_min_lr = 0.0,
                           .warmup_max_lr = 1.0,
                           .warmup_num_steps = 4,
                           .warmup_type = WarmupCurve::kLinear});
  EXPECT_EQ(s->last_batch_iteration(), -1);
  auto lrs = run_steps(*s, 7);
  std::vector<double> want{0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0};  // lr(-1), lr(0), lr(1)...
  EXPECT_EQ(lrs, want);
  EXPECT_EQ(s->last_batch_iteration(), 6);
}

TEST(LrSchedule, SkippedStepsDoNotAdvance) {
  auto s = make_warmup_lr({.warmup_min_lr = 0.0,
                           .warmup_max_lr = 1.0,
                           .warmup_num_steps = 4,
                           .warmup_type = WarmupCurve::kLinear});
  // Steps 2 and 3 overflow: step 3 and 4 repeat the lr of step 2.
  auto lrs = run_steps(*s, 6, {2, 3});
  std::vector<double> want{0.0, 0.0, 0.0, 0.0, 0.25, 0.5};
  EXPECT_EQ(lrs, want);
  EXPECT_EQ(s->last_batch_iteration(), 3);
}

TEST(LrSchedule, WarmupLogByHand) {
  // lr(i) = min + (max - min) * log(i+1)/log(N) for i < N = 10, then max.
  auto s = make_warmup_lr({.warmup_min_lr = 1e-5, .warmup_max_lr = 1e-3, .warmup_num_steps = 10});
  EXPECT_DOUBLE_EQ(s->lr_at(-1), 1e-5);
  EXPECT_DOUBLE_EQ(s->lr_at(0), 1e-5);
  EXPECT_NEAR(s->lr_at(1), 1e-5 + (1e-3 - 1e-5) * 0.30102999566398120, 1e-15);
  EXPECT_NEAR(s->lr_at(4), 1e-5 + (1e-3 - 1e-5) * 0.69897000433601886, 1e-15);
  EXPECT_NEAR(s->lr_at(9), 1e-3, 1e-15);
  EXPECT_DOUBLE_EQ(s->lr_at(10), 1e-3);
  EXPECT_DOUBLE_EQ(s->lr_at(1000), 1e-3);
}

TEST(LrSchedule, WarmupNumStepsBelowTwoActsAsTwo) {
  auto s = make_warmup_lr({.warmup_min_lr = 0,
                           .warmup_max_lr = 1,
                           .warmup_num_steps = 1,
                           .warmup_type = WarmupCurve::kLinear});
  EXPECT_DOUBLE_EQ(s->lr_at(0), 0.0);
  EXPECT_DOUBLE_EQ(s->lr_at(1), 0.5);
  EXPECT_DOUBLE_EQ(s->lr_at(2), 1.0);
}

TEST(LrSchedule, WarmupDecayByHand) {
  // N = 4 linear warmup to 1, then (total - i) / (total - N) with total 12.
  auto s = make_warmup_decay_lr({.warmup = {.warmup_min_lr = 0,
                                            .warmup_max_lr = 1,
                                            .warmup_num_steps = 4,
                                            .warmup_type = WarmupCurve::kLinear},
                                 .total_num_steps = 12});
  EXPECT_DOUBLE_EQ(s->lr_at(3), 0.75);
  EXPECT_DOUBLE_EQ(s->lr_at(4), 1.0);
  EXPECT_DOUBLE_EQ(s->lr_at(8), 0.5);
  EXPECT_DOUBLE_EQ(s->lr_at(12), 0.0);
  EXPECT_DOUBLE_EQ(s->lr_at(20), 0.0);  // clamped at 0
}

TEST(LrSchedule, WarmupCosineByHand) {
  // base 2, N = 4 linear from ratio 0.5; cosine to 0.1 over total - N = 8 steps.
  auto s = make_warmup_cosine_lr({.base_lr = 2.0,
                                  .total_num_steps = 12,
                                  .warmup_min_ratio = 0.5,
                                  .warmup_num_steps = 4,
                                  .cos_min_ratio = 0.1,
                                  .warmup_type = WarmupCurve::kLinear});
  EXPECT_DOUBLE_EQ(s->lr_at(-1), 0.0);        // DeepSpeed writes lr 0 before the first step
  EXPECT_DOUBLE_EQ(s->lr_at(0), 2.0 * 0.5);   // warmup_min_ratio
  EXPECT_DOUBLE_EQ(s->lr_at(2), 2.0 * 0.75);  // 0.5 + 0.5 * 2/4
  // i = 4: progress (4-4+1)/8 = 1/8.
  double r = 0.1 + 0.9 * (1 + std::cos(M_PI / 8)) / 2;
  EXPECT_NEAR(s->lr_at(4), 2.0 * r, 1e-15);
  // i = 7: progress 4/8, halfway: 0.1 + 0.9 * 0.5.
  EXPECT_NEAR(s->lr_at(7), 2.0 * 0.55, 1e-15);
  EXPECT_NEAR(s->lr_at(11), 2.0 * 0.1, 1e-15);  // progress 1
  EXPECT_NEAR(s->lr_at(30), 2.0 * 0.1, 1e-15);  // stays at the floor
}

TEST(LrSchedule, OneCycleByHand) {
  // first 2, second 2: scale over b = i+1 is 0, .5, 1, .5, 0 for b = 0..4 (i = -1..3).
  auto s = make_one_cycle({.cycle_min_lr = 1.0,
                           .cycle_max_lr = 3.0,
                           .decay_lr_rate = 1.0,
                           .cycle_first_step_size = 2,
                           .decay_step_size = 2,
                           .cycle_min_mom = 0.8,
                           .cycle_max_mom = 0.9,
                           .decay_mom_rate = 0.5});
  EXPECT_DOUBLE_EQ(s->lr_at(-1), 1.0);
  EXPECT_DOUBLE_EQ(s->betas_at(-1)->beta1, 0.8);  // constructor writes cycle_min_mom
  EXPECT_DOUBLE_EQ(s->betas_at(-1)->beta2, 0.99);
  EXPECT_DOUBLE_EQ(s->lr_at(0), 2.0);
  EXPECT_DOUBLE_EQ(s->betas_at(0)->beta1, 0.85);
  EXPECT_DOUBLE_EQ(s->lr_at(1), 3.0);
  EXPECT_NEAR(s->betas_at(1)->beta1, 0.8, 1e-15);
  EXPECT_DOUBLE_EQ(s->lr_at(2), 2.0);
  EXPECT_DOUBLE_EQ(s->lr_at(3), 1.0);
  // Decay: i = 4 is d = 1 of step size 2: lr = 1 / (1 + 1 * 0.5), mom = 0.9 * (1 + 0.5 * 0.5).
  EXPECT_DOUBLE_EQ(s->lr_at(4), 1.0 / 1.5);
  EXPECT_DOUBLE_EQ(s->betas_at(4)->beta1, 0.9 * 1.25);
  EXPECT_DOUBLE_EQ(s->lr_at(5), 0.5);
}

TEST(LrSchedule, ConstantNeverChangesAndHasNoBetas) {
  auto s = make_constant_lr(3e-4);
  auto lrs = run_steps(*s, 5, {2});
  for (double lr : lrs) EXPECT_EQ(lr, 3e-4);
  EXPECT_FALSE(s->betas().has_value());
  EXPECT_EQ(s->last_batch_iteration(), 3);
}

TEST(LrSchedule, StateRoundTripsAndResumesTheSequence) {
  WarmupCosineLROptions o{.base_lr = 1e-3, .total_num_steps = 50, .warmup_num_steps = 7};
  auto a = make_warmup_cosine_lr(o);
  run_steps(*a, 13, {4});
  json saved = a->state_json();
  EXPECT_EQ(saved, json({{"last_batch_iteration", 11}}));
  auto b = make_warmup_cosine_lr(o);
  b->load_state_json(saved);
  EXPECT_EQ(run_steps(*a, 20), run_steps(*b, 20));
}

TEST(LrSchedule, BadStateAndOptionsAreRejected) {
  auto s = make_constant_lr(1.0);
  EXPECT_THROW(s->load_state_json(json::object()), InvalidArgument);
  EXPECT_THROW(s->load_state_json({{"last_batch_iteration", "3"}}), InvalidArgument);
  EXPECT_THROW(s->load_state_json({{"last_batch_iteration", -2}}), InvalidArgument);
  try {
    make_warmup_lr({.warmup_num_steps = 0});
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.json_path(), "scheduler.params.warmup_num_steps");
  }
  EXPECT_THROW(make_warmup_decay_lr({.total_num_steps = 0}), ConfigError);
  EXPECT_THROW(make_warmup_cosine_lr({.total_num_steps = -1}), ConfigError);
  EXPECT_THROW(make_one_cycle({.cycle_first_step_size = 0}), ConfigError);
  EXPECT_EQ(parse_warmup_curve("linear"), WarmupCurve::kLinear);
  EXPECT_EQ(parse_warmup_curve("exp"), WarmupCurve::kLog);  // DeepSpeed warns, uses log
}

// The warning about a schedule shorter than its warmup is said when, and only when, it is true
// (`outcore demo --steps 1` said it of one step and a warmup of one).
TEST(LrSchedule, ShorterThanItsWarmupIsSaidOnlyWhenTrue) {
  {
    test::LogCapture log;
    make_warmup_cosine_lr({.base_lr = 1e-3, .total_num_steps = 1, .warmup_num_steps = 1});
    make_warmup_decay_lr({.warmup = {.warmup_num_steps = 1}, .total_num_steps = 1});
    EXPECT_EQ(log.text().find("less than warmup_num_steps"), std::string::npos) << log.text();
  }
  test::LogCapture log;
  make_warmup_cosine_lr({.base_lr = 1e-3, .total_num_steps = 3, .warmup_num_steps = 5});
  EXPECT_NE(log.text().find("total_num_steps 3 is less than warmup_num_steps 5"), std::string::npos)
      << log.text();
}

// ---- against the Python reference ----------------------------------------------------------

std::unique_ptr<LrSchedule> make_from_case(const json& c) {
  const json& p = c["params"];
  std::string type = c["type"];
  double base = c["base_lr"];
  auto curve = [&] { return parse_warmup_curve(p.value("warmup_type", "log")); };
  if (type == "constant") return make_constant_lr(base);
  if (type == "WarmupLR" || type == "WarmupDecayLR") {
    WarmupLROptions w{.warmup_min_lr = p.value("warmup_min_lr", 0.0),
                      .warmup_max_lr = p.value("warmup_max_lr", type == "WarmupLR" ? base : 0.001),
                      .warmup_num_steps = p.value("warmup_num_steps", 1000),
                      .warmup_type = curve()};
    if (type == "WarmupLR") return make_warmup_lr(w);
    return make_warmup_decay_lr({.warmup = w, .total_num_steps = p["total_num_steps"]});
  }
  if (type == "WarmupCosineLR") {
    return make_warmup_cosine_lr({.base_lr = base,
                                  .total_num_steps = p["total_num_steps"],
                                  .warmup_min_ratio = p.value("warmup_min_ratio", 0.0),
                                  .warmup_num_steps = p.value("warmup_num_steps", 1000),
                                  .cos_min_ratio = p.value("cos_min_ratio", 0.0001),
                                  .warmup_type = curve()});
  }
  OneCycleOptions o;
  o.cycle_min_lr = p["cycle_min_lr"];
  o.cycle_max_lr = p["cycle_max_lr"];
  o.decay_lr_rate = p.value("decay_lr_rate", 0.0);
  o.cycle_first_step_size = p.value("cycle_first_step_size", 2000);
  if (p.contains("cycle_second_step_size")) o.cycle_second_step_size = p["cycle_second_step_size"];
  o.cycle_first_stair_count = p.value("cycle_first_stair_count", 0);
  if (p.contains("cycle_second_stair_count"))
    o.cycle_second_stair_count = p["cycle_second_stair_count"];
  o.decay_step_size = p.value("decay_step_size", 0);
  o.cycle_momentum = p.value("cycle_momentum", true);
  o.cycle_min_mom = p.value("cycle_min_mom", 0.8);
  o.cycle_max_mom = p.value("cycle_max_mom", 0.9);
  o.decay_mom_rate = p.value("decay_mom_rate", 0.0);
  return make_one_cycle(o);
}

json oracle_cases() {
  return json::parse(R"([
    {"name": "warmup_log", "type": "WarmupLR", "base_lr": 0.01, "steps": 20, "skip": [3, 7],
     "params": {"warmup_min_lr": 1e-5, "warmup_max_lr": 1e-3, "warmup_num_steps": 10}},
    {"name": "warmup_default_max_is_base", "type": "WarmupLR", "base_lr": 0.02, "steps": 8,
     "params": {"warmup_num_steps": 5, "warmup_type": "linear"}},
    {"name": "warmup_one_step", "type": "WarmupLR", "base_lr": 0.1, "steps": 6, "skip": [1],
     "params": {"warmup_num_steps": 1, "warmup_type": "linear", "warmup_max_lr": 0.5}},
    {"name": "decay_log", "type": "WarmupDecayLR", "base_lr": 0.01, "steps": 30, "skip": [10],
     "params": {"warmup_num_steps": 5, "total_num_steps": 20, "warmup_min_lr": 1e-4}},
    {"name": "decay_linear_default_max", "type": "WarmupDecayLR", "base_lr": 0.05, "steps": 16,
     "params": {"warmup_num_steps": 3, "total_num_steps": 12, "warmup_type": "linear"}},
    {"name": "decay_total_below_warmup", "type": "WarmupDecayLR", "base_lr": 0.05, "steps": 10,
     "params": {"warmup_num_steps": 6, "total_num_steps": 4, "warmup_type": "linear"}},
    {"name": "cosine_linear", "type": "WarmupCosineLR", "base_lr": 3e-4, "steps": 35,
     "skip": [2, 20, 21],
     "params": {"total_num_steps": 25, "warmup_num_steps": 5, "warmup_min_ratio": 0.1,
                "cos_min_ratio": 0.01, "warmup_type": "linear"}},
    {"name": "cosine_log", "type": "WarmupCosineLR", "base_lr": 1e-3, "steps": 40,
     "params": {"total_num_steps": 30, "warmup_num_steps": 8}},
    {"name": "cosine_total_below_warmup", "type": "WarmupCosineLR", "base_lr": 1e-3,
     "steps": 12, "params": {"total_num_steps": 3, "warmup_num_steps": 5}},
    {"name": "one_cycle_decay", "type": "OneCycle", "base_lr": 0.1, "steps": 25, "skip": [5],
     "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 4,
                "cycle_second_step_size": 6, "decay_lr_rate": 0.5, "decay_step_size": 2,
                "cycle_min_mom": 0.85, "cycle_max_mom": 0.95, "decay_mom_rate": 0.1}},
    {"name": "one_cycle_stairs", "type": "OneCycle", "base_lr": 0.1, "steps": 20,
     "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 8,
                "cycle_second_step_size": 4, "cycle_first_stair_count": 4,
                "cycle_second_stair_count": 2}},
    {"name": "one_cycle_no_momentum_no_decay", "type": "OneCycle", "base_lr": 0.1, "steps": 14,
     "params": {"cycle_min_lr": 0.2, "cycle_max_lr": 0.6, "cycle_first_step_size": 3,
                "cycle_momentum": false, "decay_lr_rate": 0.3}},
    {"name": "constant", "type": "constant", "base_lr": 4e-4, "steps": 5, "skip": [2],
     "params": {}}
  ])");
}

TEST(LrScheduleOracle, MatchesTheReferenceImplementation) {
  std::string python = OUTCORE_PYTHON;
  if (!std::filesystem::exists(python)) OUTCORE_ORACLE_UNAVAILABLE(python + " not found");
  json cases = oracle_cases();
  std::string spec = ::testing::TempDir() + "lr_reference_spec.json";
  std::ofstream(spec) << cases.dump();
  std::string cmd =
      python + " " + OUTCORE_SOURCE_DIR + "/tests/train/oracle/lr_reference.py " + spec;
  std::unique_ptr<FILE, int (*)(FILE*)> pipe(popen(cmd.c_str(), "r"), pclose);
  ASSERT_TRUE(pipe);
  std::string out;
  std::array<char, 4096> buf{};
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), pipe.get())) > 0) out.append(buf.data(), n);
  ASSERT_EQ(pclose(pipe.release()), 0) << out;
  json ref = json::parse(out);

  for (const json& c : cases) {
    SCOPED_TRACE(c["name"].get<std::string>());
    auto s = make_from_case(c);
    std::set<int> skip;
    for (int k : c.value("skip", json::array())) skip.insert(k);
    const json& r = ref[c["name"].get<std::string>()];
    const bool momentum = !r["beta1"].is_null();
    int steps = c["steps"];
    ASSERT_EQ(r["lr"].size(), static_cast<size_t>(steps));
    for (int k = 1; k <= steps; ++k) {
      double want = r["lr"][k - 1];
      EXPECT_NEAR(s->lr(), want, 1e-15 + 1e-13 * std::fabs(want)) << "lr of step " << k;
      auto betas = s->betas();
      EXPECT_EQ(betas.has_value(), momentum) << "step " << k;
      if (momentum && betas) {
        EXPECT_NEAR(betas->beta1, r["beta1"][k - 1].get<double>(), 1e-14) << "beta1 of step " << k;
        EXPECT_EQ(betas->beta2, r["beta2"][k - 1].get<double>()) << "beta2 of step " << k;
      }
      if (!skip.contains(k)) s->step();
    }
    EXPECT_EQ(s->last_batch_iteration(), r["last_batch_iteration"].get<int64_t>());
  }
}

}  // namespace
}  // namespace outcore::train
