// Config adapters: DeepSpeed JSON sections, parsed by engine/config, give the schedule and
// loss scaler DeepSpeed would build.
#include "engine/train/config_adapters.hpp"

#include <gtest/gtest.h>

#include <string>

#include "engine/config/config.hpp"

namespace outcore::train {
namespace {

config::Config parse(const std::string& text) {
  config::Config cfg = config::parse_config(text, "test.json").config;
  config::resolve_auto(cfg, {});
  return cfg;
}

TEST(ConfigAdapters, NoSchedulerIsTheOptimizersConstantLr) {
  auto s = make_lr_schedule(parse(R"({"train_batch_size": 8,
      "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}})"));
  EXPECT_EQ(s->name(), "constant");
  EXPECT_EQ(s->lr(), 3e-4);
}

TEST(ConfigAdapters, WarmupLRDefaultsItsMaxToTheOptimizersLr) {
  auto s = make_lr_schedule(parse(R"({"train_batch_size": 8,
      "optimizer": {"type": "AdamW", "params": {"lr": 0.02}},
      "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4,
                                                   "warmup_type": "linear"}}})"));
  EXPECT_EQ(s->name(), "WarmupLR");
  EXPECT_DOUBLE_EQ(s->lr_at(2), 0.01);
  EXPECT_DOUBLE_EQ(s->lr_at(10), 0.02);
}

TEST(ConfigAdapters, WarmupDecayLRDefaultsItsMaxTo0001) {
  auto s = make_lr_schedule(parse(R"({"train_batch_size": 8,
      "optimizer": {"type": "AdamW", "params": {"lr": 0.02}},
      "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 10,
                                                        "warmup_num_steps": 2}}})"));
  EXPECT_EQ(s->name(), "WarmupDecayLR");
  EXPECT_DOUBLE_EQ(s->lr_at(2), 0.001);
  EXPECT_DOUBLE_EQ(s->lr_at(10), 0.0);
}

TEST(ConfigAdapters, WarmupCosineLRScalesTheOptimizersLr) {
  auto s = make_lr_schedule(parse(R"({"train_batch_size": 8,
      "optimizer": {"type": "AdamW", "params": {"lr": 0.5}},
      "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10,
                     "warmup_num_steps": 2, "cos_min_ratio": 0.2}}})"));
  EXPECT_EQ(s->name(), "WarmupCosineLR");
  EXPECT_DOUBLE_EQ(s->lr_at(-1), 0.0);
  EXPECT_NEAR(s->lr_at(9), 0.5 * 0.2, 1e-15);
}

TEST(ConfigAdapters, OneCycleCarriesMomentum) {
  auto s = make_lr_schedule(parse(R"({"train_batch_size": 8,
      "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 0.3,
                     "cycle_first_step_size": 2, "cycle_min_mom": 0.7, "cycle_max_mom": 0.9}}})"));
  EXPECT_EQ(s->name(), "OneCycle");
  EXPECT_DOUBLE_EQ(s->lr_at(1), 0.3);
  EXPECT_DOUBLE_EQ(s->betas_at(1)->beta1, 0.7);
}

TEST(ConfigAdapters, LossScalerFollowsThePrecision) {
  EXPECT_FALSE(make_loss_scaler(parse(R"({"train_batch_size": 8})")).dynamic());
  EXPECT_EQ(
      make_loss_scaler(parse(R"({"train_batch_size": 8, "bf16": {"enabled": true}})")).scale(),
      1.0);
  LossScaler d = make_loss_scaler(parse(R"({"train_batch_size": 8,
      "fp16": {"enabled": true, "initial_scale_power": 12, "hysteresis": 3}})"));
  EXPECT_TRUE(d.dynamic());
  EXPECT_EQ(d.scale(), 4096.0);
  EXPECT_EQ(d.hysteresis(), 3);
  LossScaler st = make_loss_scaler(parse(R"({"train_batch_size": 8,
      "fp16": {"enabled": true, "loss_scale": 128}})"));
  EXPECT_FALSE(st.dynamic());
  EXPECT_EQ(st.scale(), 128.0);
}

TEST(ConfigAdapters, UnresolvedAutoNamesItsPath) {
  config::Config cfg = config::parse_config(R"({"train_batch_size": 8,
      "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}})",
                                            "t.json")
                           .config;
  try {
    make_lr_schedule(cfg);
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.json_path(), "optimizer.params.lr");
  }
}

}  // namespace
}  // namespace outcore::train
