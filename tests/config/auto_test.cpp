// "auto" values: kept unresolved by the parser, filled by resolve_auto from the model and
// the command line, reported clearly when still unresolved.
#include <gtest/gtest.h>

#include "tests/config/config_test_util.hpp"

namespace outcore::config {
namespace {

using testing::dump;
using testing::errors_of;
using testing::has_issue;
using testing::source_path;

ParsedConfig load_user_file() {
  return load_config_file(source_path("tests/config/data/hf_zero3_auto.json"));
}

TEST(Auto, UserFileWithCommentsAndAutoParsesCleanly) {
  ParsedConfig p = load_user_file();
  // The file's only warnings are for keys outcore accepts but does not act on.
  ASSERT_EQ(p.warnings.size(), 1u) << dump(p.warnings);
  EXPECT_EQ(p.warnings[0].json_path, "zero_optimization.stage3_gather_16bit_weights_on_model_save");
  EXPECT_NE(p.warnings[0].message.find("no effect in outcore"), std::string::npos);
  const Config& c = p.config;
  EXPECT_TRUE(c.train_batch_size.is_auto());
  EXPECT_TRUE(c.fp16.enabled.is_auto());
  EXPECT_TRUE(c.optimizer.lr.is_auto());
  EXPECT_TRUE(c.zero_optimization.reduce_bucket_size.is_auto());
  EXPECT_EQ(c.zero_optimization.stage, 3);
  EXPECT_EQ(c.zero_optimization.sub_group_size, 1'000'000'000);
  EXPECT_EQ(c.steps_per_print, 2000);
  std::vector<std::string> want = {"train_batch_size",
                                   "train_micro_batch_size_per_gpu",
                                   "gradient_accumulation_steps",
                                   "gradient_clipping",
                                   "fp16.enabled",
                                   "bf16.enabled",
                                   "optimizer.params.lr",
                                   "optimizer.params.betas",
                                   "optimizer.params.eps",
                                   "optimizer.params.weight_decay",
                                   "scheduler.params.warmup_min_lr",
                                   "scheduler.params.warmup_max_lr",
                                   "scheduler.params.warmup_num_steps",
                                   "scheduler.params.total_num_steps",
                                   "zero_optimization.reduce_bucket_size",
                                   "zero_optimization.stage3_prefetch_bucket_size",
                                   "zero_optimization.stage3_param_persistence_threshold"};
  EXPECT_EQ(unresolved_auto(c), want);
}

TEST(Auto, ResolvedFromModelAndCommandLine) {
  Config c = load_user_file().config;
  AutoContext ctx;
  ctx.world_size = 2;
  ctx.hidden_size = 4096;
  ctx.lr = 2e-5;
  ctx.micro_batch_size = 2;
  ctx.gradient_accumulation_steps = 4;
  ctx.total_steps = 1000;
  ctx.warmup_steps = 30;
  ctx.bf16 = true;
  resolve_auto(c, ctx);
  EXPECT_TRUE(unresolved_auto(c).empty());
  EXPECT_NO_THROW(require_resolved(c));
  EXPECT_EQ(c.train_micro_batch_size_per_gpu.value(), 2);
  EXPECT_EQ(c.gradient_accumulation_steps.value(), 4);
  EXPECT_EQ(c.train_batch_size.value(), 2 * 4 * 2);
  EXPECT_DOUBLE_EQ(c.gradient_clipping.value(), 1.0);
  EXPECT_FALSE(c.fp16.enabled.value());
  EXPECT_TRUE(c.bf16.enabled.value());
  EXPECT_DOUBLE_EQ(c.optimizer.lr.value(), 2e-5);
  EXPECT_DOUBLE_EQ(c.optimizer.betas.value()[1], 0.999);
  EXPECT_DOUBLE_EQ(c.optimizer.eps.value(), 1e-8);
  EXPECT_DOUBLE_EQ(c.optimizer.weight_decay.value(), 0.0);
  EXPECT_DOUBLE_EQ(c.scheduler.warmup.warmup_min_lr.value(), 0.0);
  EXPECT_DOUBLE_EQ(c.scheduler.warmup.warmup_max_lr.value(), 2e-5);
  EXPECT_EQ(c.scheduler.warmup.warmup_num_steps.value(), 30);
  EXPECT_EQ(c.scheduler.warmup.total_num_steps.value(), 1000);
  // The Hugging Face integration's formulas from the hidden size.
  EXPECT_EQ(c.zero_optimization.reduce_bucket_size.value(), 4096 * 4096);
  EXPECT_EQ(c.zero_optimization.stage3_prefetch_bucket_size.value(), 15'099'494);  // 0.9 h^2
  EXPECT_EQ(c.zero_optimization.stage3_param_persistence_threshold.value(), 10 * 4096);
}

TEST(Auto, PartialContextLeavesTheRestAuto) {
  Config c = load_user_file().config;
  AutoContext ctx;
  ctx.micro_batch_size = 4;
  resolve_auto(c, ctx);
  // Batch: micro from the command line, gas "auto" counts as missing -> 1.
  EXPECT_EQ(c.train_batch_size.value(), 4);
  EXPECT_EQ(c.gradient_accumulation_steps.value(), 1);
  // Defaults that need no facts are filled; the rest stays "auto".
  EXPECT_DOUBLE_EQ(c.gradient_clipping.value(), 1.0);
  EXPECT_FALSE(c.fp16.enabled.value());
  std::vector<std::string> want = {"optimizer.params.lr",
                                   "scheduler.params.warmup_max_lr",
                                   "scheduler.params.warmup_num_steps",
                                   "scheduler.params.total_num_steps",
                                   "zero_optimization.reduce_bucket_size",
                                   "zero_optimization.stage3_prefetch_bucket_size",
                                   "zero_optimization.stage3_param_persistence_threshold"};
  EXPECT_EQ(unresolved_auto(c), want);
}

TEST(Auto, RequireResolvedNamesEveryValueAndItsSource) {
  Config c = load_user_file().config;
  resolve_auto(c, AutoContext{});
  auto issues = errors_of([&] { require_resolved(c); });
  EXPECT_TRUE(has_issue(issues, "train_batch_size", "--train-batch-size")) << dump(issues);
  EXPECT_TRUE(has_issue(issues, "optimizer.params.lr", "--lr"));
  EXPECT_TRUE(has_issue(issues, "scheduler.params.total_num_steps", "--total-steps"));
  EXPECT_TRUE(has_issue(issues, "zero_optimization.reduce_bucket_size", "--hidden-size"));
  EXPECT_EQ(issues.size(), 10u) << dump(issues);
}

TEST(Auto, ReadingAnUnresolvedValueThrowsNamingIt) {
  Config c = load_user_file().config;
  try {
    (void)c.optimizer.lr.value();
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.json_path(), "optimizer.params.lr");
    EXPECT_NE(std::string(e.what()).find("\"auto\""), std::string::npos);
  }
  Config empty;
  EXPECT_THROW((void)empty.train_batch_size.value(), ConfigError);
  EXPECT_EQ(c.optimizer.lr.value_or(0.5), 0.5);
}

TEST(Auto, ConcreteValuesInTheFileWin) {
  Config c = parse_config(R"({"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "Adam",
      "params": {"lr": 0.01}}, "zero_optimization": {"reduce_bucket_size": 1000}})")
                 .config;
  AutoContext ctx;
  ctx.micro_batch_size = 2;
  ctx.lr = 0.5;
  ctx.hidden_size = 64;
  resolve_auto(c, ctx);
  EXPECT_EQ(c.train_micro_batch_size_per_gpu.value(), 8);
  EXPECT_DOUBLE_EQ(c.optimizer.lr.value(), 0.01);
  EXPECT_EQ(c.zero_optimization.reduce_bucket_size.value(), 1000);
  EXPECT_EQ(c.zero_optimization.stage3_prefetch_bucket_size.value(), 50'000'000);  // not auto
}

TEST(Auto, PrecisionAndClippingFromContext) {
  const char* text = R"({"train_batch_size": 8, "fp16": {"enabled": "auto"},
      "bf16": {"enabled": "auto"}, "gradient_clipping": "auto"})";
  Config c = parse_config(text).config;
  AutoContext ctx;
  ctx.fp16 = true;
  ctx.gradient_clipping = 0.5;
  resolve_auto(c, ctx);
  EXPECT_TRUE(c.fp16.enabled.value());
  EXPECT_FALSE(c.bf16.enabled.value());
  EXPECT_DOUBLE_EQ(c.gradient_clipping.value(), 0.5);

  Config both = parse_config(text).config;
  ctx.bf16 = true;
  EXPECT_TRUE(has_issue(errors_of([&] { resolve_auto(both, ctx); }), "bf16.enabled",
                        "at most one of fp16 and bf16"));
}

TEST(Auto, WarmupLRPeaksAtTheOptimizerLr) {
  Config c = parse_config(R"({"train_batch_size": 8, "optimizer": {"type": "AdamW",
      "params": {"lr": 3e-4}}, "scheduler": {"type": "WarmupLR"}})")
                 .config;
  resolve_auto(c, AutoContext{});
  EXPECT_DOUBLE_EQ(c.scheduler.warmup.warmup_max_lr.value(), 3e-4);

  Config a = parse_config(R"({"train_batch_size": 8, "optimizer": {"type": "AdamW",
      "params": {"lr": "auto"}}, "scheduler": {"type": "WarmupLR"}})")
                 .config;
  AutoContext ctx;
  ctx.lr = 1e-4;
  resolve_auto(a, ctx);
  EXPECT_DOUBLE_EQ(a.optimizer.lr.value(), 1e-4);
  EXPECT_DOUBLE_EQ(a.scheduler.warmup.warmup_max_lr.value(), 1e-4);
}

TEST(Auto, CosineSchedulerAuto) {
  Config c = parse_config(R"({"train_batch_size": 8, "scheduler": {"type": "WarmupCosineLR",
      "params": {"total_num_steps": "auto", "warmup_num_steps": "auto"}}})")
                 .config;
  AutoContext ctx;
  ctx.total_steps = 500;
  ctx.warmup_steps = 50;
  resolve_auto(c, ctx);
  EXPECT_EQ(c.scheduler.cosine.total_num_steps.value(), 500);
  EXPECT_EQ(c.scheduler.cosine.warmup_num_steps.value(), 50);
}

TEST(Auto, BadContextIsRejected) {
  Config c = parse_config(R"({"train_batch_size": 8})").config;
  AutoContext ctx;
  ctx.world_size = 0;
  ctx.hidden_size = -3;
  ctx.lr = -1;
  auto issues = errors_of([&] { resolve_auto(c, ctx); });
  EXPECT_EQ(issues.size(), 3u) << dump(issues);
}

}  // namespace
}  // namespace outcore::config
