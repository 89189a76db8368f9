// parse_config: one test per class of bad input, plus the accepted DeepSpeed variants.
#include <gtest/gtest.h>

#include "tests/config/config_test_util.hpp"

namespace outcore::config {
namespace {

using testing::dump;
using testing::has_issue;
using testing::parse_errors;

// ---- bad input: one class per test ------------------------------------------------------

TEST(ParseBadInput, MalformedJsonHasLineAndColumn) {
  auto issues = parse_errors("{\n  \"train_batch_size\": 8\n  \"fp16\": {}\n}");
  ASSERT_EQ(issues.size(), 1u);
  EXPECT_NE(issues[0].message.find("line 3, column 3"), std::string::npos) << dump(issues);
}

TEST(ParseBadInput, TopLevelMustBeAnObject) {
  auto issues = parse_errors("[1, 2]");
  ASSERT_EQ(issues.size(), 1u);
  EXPECT_NE(issues[0].message.find("must be a JSON object"), std::string::npos);
}

TEST(ParseBadInput, DuplicateKeyRejected) {
  auto issues = parse_errors(R"({"train_batch_size": 8, "train_batch_size": 16})");
  EXPECT_TRUE(has_issue(issues, "train_batch_size", "duplicate key")) << dump(issues);
}

TEST(ParseBadInput, WrongTypeNamesPathValueAndAllowed) {
  auto issues = parse_errors(R"({"zero_optimization": {"overlap_comm": 3},
                                 "aio": {"queue_depth": "deep"},
                                 "outcore": {"metrics_file": 7}})");
  EXPECT_TRUE(has_issue(issues, "zero_optimization.overlap_comm", "got 3; allowed: true or false"))
      << dump(issues);
  EXPECT_TRUE(has_issue(issues, "aio.queue_depth", "got \"deep\"; allowed: an integer in 1..4096"))
      << dump(issues);
  EXPECT_TRUE(has_issue(issues, "outcore.metrics_file", "got 7; allowed: a string or null"))
      << dump(issues);
}

TEST(ParseBadInput, OutOfRangeValue) {
  auto issues = parse_errors(R"({"zero_optimization": {"stage": 4},
                                 "fp16": {"loss_scale": -1, "initial_scale_power": 64},
                                 "train_micro_batch_size_per_gpu": 0})");
  EXPECT_TRUE(has_issue(issues, "zero_optimization.stage", "got 4; allowed: an integer in 0..3"))
      << dump(issues);
  EXPECT_TRUE(has_issue(issues, "fp16.loss_scale", "got -1; allowed: a number in [0, "))
      << dump(issues);
  // A static scale beyond fp32's range would overflow every step.
  EXPECT_TRUE(has_issue(parse_errors(R"({"fp16": {"enabled": true, "loss_scale": 1e39}})"),
                        "fp16.loss_scale", "allowed: a number in [0, 3.4028234663852886e+38]"));
  EXPECT_TRUE(has_issue(issues, "fp16.initial_scale_power", "in 0..63"));
  EXPECT_TRUE(has_issue(issues, "train_micro_batch_size_per_gpu",
                        "got 0; allowed: an integer in 1..1048576"));
}

TEST(ParseBadInput, SectionThatIsNotAnObject) {
  auto issues = parse_errors(R"({"zero_optimization": 3, "aio": [1]})");
  EXPECT_TRUE(has_issue(issues, "zero_optimization", "allowed: an object")) << dump(issues);
  EXPECT_TRUE(has_issue(issues, "aio", "allowed: an object")) << dump(issues);
}

TEST(ParseBadInput, NonIntegralFloatForAnInteger) {
  auto issues =
      parse_errors(R"({"train_batch_size": 2.5, "zero_optimization": {"sub_group_size": 1e30}})");
  EXPECT_TRUE(has_issue(issues, "train_batch_size", "got 2.5")) << dump(issues);
  EXPECT_TRUE(has_issue(issues, "zero_optimization.sub_group_size", "got 1e+30")) << dump(issues);
}

TEST(ParseBadInput, UnsupportedOptimizerIsNamedWithTheSupportedOnes) {
  auto issues = parse_errors(R"({"optimizer": {"type": "Lamb", "params": {"lr": 0.1}}})");
  ASSERT_TRUE(has_issue(issues, "optimizer.type", "got \"Lamb\"")) << dump(issues);
  EXPECT_TRUE(has_issue(issues, "optimizer.type", "allowed: \"Adam\" or \"AdamW\""));
  EXPECT_FALSE(parse_errors(R"({"optimizer": {"params": {}}})").empty());  // type missing
}

TEST(ParseBadInput, RejectedOptimizerParams) {
  auto issues = parse_errors(R"({"optimizer": {"type": "Adam", "params": {
      "max_grad_norm": 1.0, "amsgrad": true, "betas": [0.9], "eps": 0}}})");
  EXPECT_TRUE(has_issue(issues, "optimizer.params.max_grad_norm", "gradient_clipping"))
      << dump(issues);
  EXPECT_TRUE(has_issue(issues, "optimizer.params.amsgrad", "allowed: false"));
  EXPECT_TRUE(has_issue(issues, "optimizer.params.betas", "[beta1, beta2]"));
  EXPECT_TRUE(has_issue(issues, "optimizer.params.eps", "a number in [1.4")) << dump(issues);
  // Adam computes in fp32: an eps that is 0 or infinite there is refused, its least is not.
  for (const char* eps : {"1e-46", "1e39"})
    EXPECT_TRUE(
        has_issue(parse_errors(std::string(R"({"optimizer": {"type": "Adam", "params": {"eps": )") +
                               eps + "}}}"),
                  "optimizer.params.eps", "a number in [1.4"))
        << eps;
  const ParsedConfig least = parse_config(
      R"({"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"eps": 1.5e-45}}})");
  EXPECT_EQ(least.config.optimizer.eps.value(), 1.5e-45);
}

TEST(ParseBadInput, UnsupportedSchedulerIsNamedWithTheSupportedOnes) {
  auto issues = parse_errors(R"({"scheduler": {"type": "LRRangeTest", "params": {}}})");
  EXPECT_TRUE(
      has_issue(issues, "scheduler.type",
                "allowed: \"WarmupLR\", \"WarmupDecayLR\", \"WarmupCosineLR\" or \"OneCycle\""))
      << dump(issues);
}

TEST(ParseBadInput, SchedulerRequiredParamsMissing) {
  auto decay = parse_errors(R"({"scheduler": {"type": "WarmupDecayLR", "params": {}}})");
  EXPECT_TRUE(has_issue(decay, "scheduler.params.total_num_steps", "required by WarmupDecayLR"))
      << dump(decay);
  auto cosine = parse_errors(R"({"scheduler": {"type": "WarmupCosineLR"}})");
  EXPECT_TRUE(has_issue(cosine, "scheduler.params.total_num_steps", "required by WarmupCosineLR"));
  auto cycle =
      parse_errors(R"({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.1}}})");
  EXPECT_TRUE(has_issue(cycle, "scheduler.params.cycle_max_lr", "required by OneCycle"));
  auto order = parse_errors(
      R"({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 0.01}}})");
  EXPECT_TRUE(has_issue(order, "scheduler.params.cycle_max_lr", ">= cycle_min_lr"));
  auto warmup =
      parse_errors(R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": 3}}})");
  EXPECT_TRUE(has_issue(warmup, "scheduler.params.warmup_type", "allowed: \"log\" or \"linear\""));
  // An invalid value is not also said to be missing.
  auto zero =
      parse_errors(R"({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 0}}})");
  EXPECT_EQ(zero.size(), 1u) << dump(zero);
}

// warmup_type is compared exactly, as DeepSpeed does: any other string ("Linear", "cosine")
// warms up with log, as there, and is warned about.
TEST(Parse, AWarmupTypeOtherThanLogOrLinearIsLogWithAWarning) {
  for (const char* name : {"Linear", "cosine"}) {
    const ParsedConfig p = parse_config(
        std::string(R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": ")") + name +
            "\"}}}",
        "w");
    EXPECT_EQ(p.config.scheduler.warmup.warmup_type, WarmupType::kLog) << name;
    ASSERT_EQ(p.warnings.size(), 1u) << name;
    EXPECT_EQ(p.warnings[0].json_path, "scheduler.params.warmup_type");
    EXPECT_NE(p.warnings[0].message.find("the warmup is log, as in DeepSpeed"), std::string::npos)
        << p.warnings[0].message;
  }
  EXPECT_EQ(parse_config(R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_type":
      "linear"}}})",
                         "w")
                .config.scheduler.warmup.warmup_type,
            WarmupType::kLinear);
}

TEST(ParseBadInput, Fp16AndBf16BothEnabled) {
  auto issues = parse_errors(R"({"fp16": {"enabled": true}, "bf16": {"enabled": true}})");
  EXPECT_TRUE(has_issue(issues, "bf16.enabled", "at most one of fp16 and bf16")) << dump(issues);
  // One of them enabled, the other "auto": fine until resolution.
  EXPECT_NO_THROW(parse_config(R"({"fp16": {"enabled": true}, "bf16": {"enabled": "auto"}})"));
}

TEST(ParseBadInput, NvmeOffloadWithoutNvmePath) {
  auto issues = parse_errors(R"({"zero_optimization": {"stage": 3,
      "offload_param": {"device": "nvme"},
      "offload_optimizer": {"device": "nvme", "nvme_path": null}}})");
  EXPECT_TRUE(has_issue(issues, "zero_optimization.offload_param.nvme_path",
                        "required when device is \"nvme\""))
      << dump(issues);
  EXPECT_TRUE(has_issue(issues, "zero_optimization.offload_optimizer.nvme_path",
                        "required when device is \"nvme\""));
}

// A string with a NUL would be cut there by the system (a metrics file "m.jsonl\u0000x" written
// as m.jsonl, replacing it): refused naming the key.
TEST(ParseBadInput, AStringHoldingANulIsRefused) {
  auto issues = parse_errors(R"({"zero_optimization": {"stage": 3,
      "offload_param": {"device": "nvme", "nvme_path": "sw\u0000x"}},
      "outcore": {"metrics_file": "m.jsonl\u0000-other.jsonl"}})");
  EXPECT_TRUE(has_issue(issues, "zero_optimization.offload_param.nvme_path",
                        "\"sw\\u0000x\" holds a NUL character"))
      << dump(issues);
  EXPECT_TRUE(has_issue(issues, "outcore.metrics_file", "holds a NUL character")) << dump(issues);
}

// A learning rate or weight decay fp32 cannot hold would be infinite in Adam's fp32 step (the
// first step's loss NaN, exit 1): refused as bad input, naming the key.
TEST(ParseBadInput, AnLrBeyondFp32IsRefused) {
  auto issues = parse_errors(R"({"optimizer": {"type": "AdamW",
      "params": {"lr": 1e300, "weight_decay": 1e39}},
      "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e40}}})");
  for (const char* key :
       {"optimizer.params.lr", "optimizer.params.weight_decay", "scheduler.params.warmup_max_lr"})
    EXPECT_TRUE(has_issue(issues, key, "allowed: a number in [0, 3.40282")) << key << "\n"
                                                                            << dump(issues);
}

TEST(ParseBadInput, UnknownOffloadDevice) {
  auto issues = parse_errors(R"({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}})");
  EXPECT_TRUE(has_issue(issues, "zero_optimization.offload_optimizer.device",
                        "got \"gpu\"; allowed: \"none\", \"cpu\" or \"nvme\""))
      << dump(issues);
}

TEST(ParseBadInput, AutoWhereItIsNotAccepted) {
  auto issues = parse_errors(R"({"steps_per_print": "auto", "aio": {"queue_depth": "auto"},
      "optimizer": {"type": "Adam", "params": {"bias_correction": "auto"}}})");
  EXPECT_TRUE(has_issue(issues, "steps_per_print", "got \"auto\"")) << dump(issues);
  EXPECT_TRUE(has_issue(issues, "aio.queue_depth", "got \"auto\""));
  EXPECT_TRUE(has_issue(issues, "optimizer.params.bias_correction", "got \"auto\""));
}

TEST(ParseBadInput, NamesForOneSettingWithDifferentValues) {
  auto issues = parse_errors(R"({"aio": {"intra_op_parallelism": 2, "num_threads": 4},
      "zero_optimization": {"stage3_prefetch_bucket_size": 1, "prefetch_bucket_size": 2},
      "bf16": {"enabled": true}, "bfloat16": {"enabled": false}})");
  EXPECT_TRUE(has_issue(issues, "aio.num_threads", "same setting")) << dump(issues);
  EXPECT_TRUE(has_issue(issues, "zero_optimization.prefetch_bucket_size", "same setting"));
  EXPECT_TRUE(has_issue(issues, "bfloat16", "same setting"));
}

TEST(ParseBadInput, LegacyAndCurrentOffloadTogether) {
  auto issues = parse_errors(R"({"zero_optimization": {"stage": 2, "cpu_offload": true,
      "offload_optimizer": {"device": "cpu"}}})");
  EXPECT_TRUE(has_issue(issues, "zero_optimization.cpu_offload", "keep offload_optimizer"))
      << dump(issues);
}

TEST(ParseBadInput, InconsistentCombinations) {
  auto issues = parse_errors(R"({
      "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
      "aio": {"block_size": 1000},
      "activation_checkpointing": {"contiguous_memory_optimization": true},
      "bf16": {"bf16_optimizer_states": true},
      "outcore": {"log_level": "loud"}})");
  EXPECT_TRUE(has_issue(issues, "aio.block_size", "multiple of 4096")) << dump(issues);
  EXPECT_TRUE(has_issue(issues, "activation_checkpointing.contiguous_memory_optimization",
                        "partition_activations"));
  EXPECT_TRUE(has_issue(issues, "bf16.bf16_optimizer_states", "bf16_master_weights_and_grads"));
  EXPECT_TRUE(has_issue(issues, "outcore.log_level", "got \"loud\""));
}

TEST(ParseBadInput, CpuAdamCoresPercIsAShareOfTheThreads) {
  for (const char* v : {"0", "1.5", "-0.2", "\"most\""}) {
    const auto issues =
        parse_errors(std::string(R"({"zero_optimization": {"stage": 2, "offload_optimizer": )") +
                     R"({"device": "cpu", "cpuadam_cores_perc": )" + v + "}}}");
    EXPECT_TRUE(has_issue(issues, "zero_optimization.offload_optimizer.cpuadam_cores_perc",
                          "a number in (0, 1]"))
        << v << ": " << dump(issues);
  }
}

TEST(ParseBadInput, EveryErrorIsReportedAtOnce) {
  try {
    parse_config(R"({"train_batch_size": -1, "gradient_clipping": "big",
        "fp16": {"hysteresis": 0}, "optimizer": {"type": "SGD"},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})",
                 "mine.json");
    FAIL() << "expected an error";
  } catch (const ConfigValidationError& e) {
    EXPECT_EQ(e.issues().size(), 5u) << dump(e.issues());
    std::string what = e.what();
    EXPECT_EQ(what.rfind("mine.json: 5 errors:", 0), 0u) << what;
    for (const char* path : {"train_batch_size", "gradient_clipping", "fp16.hysteresis",
                             "optimizer.type", "zero_optimization.offload_param.nvme_path"}) {
      EXPECT_NE(what.find(std::string("\n  ") + path + ": "), std::string::npos) << path;
    }
  }
}

TEST(ParseBadInput, ErrorsInsideANestedSectionAreInFileOrder) {
  // The reader checks device before pin_memory; the file has them the other way round.
  auto issues = parse_errors(
      R"({"zero_optimization": {"offload_param": {"pin_memory": 3, "device": "gpu"}}})");
  ASSERT_EQ(issues.size(), 2u) << dump(issues);
  EXPECT_EQ(issues[0].json_path, "zero_optimization.offload_param.pin_memory");
  EXPECT_EQ(issues[1].json_path, "zero_optimization.offload_param.device");
}

TEST(ParseBadInput, SingleErrorMessageFitsOnOneLine) {
  try {
    parse_config(R"({"zero_optimization": {"stage": 9}})", "one.json");
    FAIL() << "expected an error";
  } catch (const ConfigError& e) {
    EXPECT_STREQ(e.what(), "one.json: zero_optimization.stage: got 9; allowed: an integer in 0..3");
  }
}

TEST(ParseBadInput, UnreadableFile) {
  try {
    load_config_file("/nonexistent/dir/ds_config.json");
    FAIL() << "expected an error";
  } catch (const ConfigValidationError& e) {
    EXPECT_EQ(e.source(), "/nonexistent/dir/ds_config.json");
    EXPECT_NE(std::string(e.what()).find("No such file"), std::string::npos) << e.what();
  }
  EXPECT_THROW(load_config_file("/"), ConfigValidationError);  // a directory
}

// ---- warnings ---------------------------------------------------------------------------

TEST(ParseWarnings, UnknownKeysNamedByPathInFileOrder) {
  ParsedConfig p = parse_config(R"({
      "train_batch_size": 8,
      "mystery": 1,
      "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_sise": 10,
                            "offload_param": {"devise": "cpu"}},
      "optimizer": {"type": "AdamW", "params": {"lr": 0.1, "momentum": 0.9}}})");
  ASSERT_EQ(p.warnings.size(), 4u) << dump(p.warnings);
  EXPECT_EQ(p.warnings[0].json_path, "mystery");
  EXPECT_EQ(p.warnings[0].message, "unknown key; ignored");
  EXPECT_EQ(p.warnings[1].json_path, "zero_optimization.stage3_prefetch_bucket_sise");
  EXPECT_NE(p.warnings[1].message.find("did you mean \"stage3_prefetch_bucket_size\""),
            std::string::npos);
  EXPECT_EQ(p.warnings[2].json_path, "zero_optimization.offload_param.devise");
  EXPECT_NE(p.warnings[2].message.find("\"device\""), std::string::npos);
  EXPECT_EQ(p.warnings[3].json_path, "optimizer.params.momentum");
}

TEST(ParseWarnings, IgnoredDeepSpeedSettingsWarnOnlyWhenNotDefault) {
  ParsedConfig quiet = parse_config(R"({"train_batch_size": 8, "dump_state": false,
      "wandb": {"enabled": false}, "zero_force_ds_cpu_optimizer": true})");
  EXPECT_TRUE(quiet.warnings.empty()) << dump(quiet.warnings);
  ParsedConfig loud = parse_config(R"({"train_batch_size": 8, "dump_state": true,
      "wandb": {"enabled": true, "project": "x"}, "zero_optimization": {"zero_quantized_weights": true}})");
  EXPECT_TRUE(has_issue(loud.warnings, "dump_state", "does not implement")) << dump(loud.warnings);
  EXPECT_TRUE(has_issue(loud.warnings, "wandb", "not used by outcore"));
  EXPECT_TRUE(
      has_issue(loud.warnings, "zero_optimization.zero_quantized_weights", "does not implement"));
}

TEST(ParseWarnings, OffloadBelowStage3) {
  ParsedConfig p = parse_config(R"({"zero_optimization": {"stage": 2,
      "offload_param": {"device": "cpu"},
      "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"}}})");
  EXPECT_TRUE(has_issue(p.warnings, "zero_optimization.offload_param.device", "only with stage 3"))
      << dump(p.warnings);
  EXPECT_TRUE(
      has_issue(p.warnings, "zero_optimization.offload_optimizer.device", "stays in host memory"));
  EXPECT_EQ(p.config.zero_optimization.offload_optimizer.device, OffloadDevice::kNvme);
}

// ---- accepted variants ------------------------------------------------------------------

TEST(ParseAccepted, IntegersWrittenAsFloats) {
  ParsedConfig p = parse_config(R"({"zero_optimization": {"reduce_bucket_size": 2e8,
      "sub_group_size": 1.0e9, "stage3_max_live_parameters": 3e8}, "train_batch_size": 8.0})");
  EXPECT_EQ(p.config.zero_optimization.reduce_bucket_size.value(), 200'000'000);
  EXPECT_EQ(p.config.zero_optimization.sub_group_size, 1'000'000'000);
  EXPECT_EQ(p.config.zero_optimization.stage3_max_live_parameters, 300'000'000);
  EXPECT_EQ(p.config.train_batch_size.value(), 8);
}

TEST(ParseAccepted, AioFromTheTuningToolAsPrinted) {
  // ds_nvme_tune prints num_threads and booleans as strings.
  ParsedConfig p = parse_config(R"({"aio": {"single_submit": "false", "overlap_events": "true",
      "num_threads": 8, "queue_depth": 32, "block_size": 1048576}})");
  EXPECT_TRUE(p.warnings.empty()) << dump(p.warnings);
  EXPECT_EQ(p.config.aio.intra_op_parallelism, 8);
  EXPECT_FALSE(p.config.aio.single_submit);
  EXPECT_TRUE(p.config.aio.overlap_events);
  EXPECT_EQ(p.config.aio.queue_depth, 32);
  EXPECT_EQ(parse_config(R"({"aio": {"thread_count": 3}})").config.aio.intra_op_parallelism, 3);
  // Two names with the same value are not a conflict.
  EXPECT_EQ(parse_config(R"({"aio": {"thread_count": 2, "num_threads": 2}})")
                .config.aio.intra_op_parallelism,
            2);
}

TEST(ParseAccepted, CaseInsensitiveOptimizerAndAdamWMode) {
  Config adamw = parse_config(R"({"optimizer": {"type": "adamw"}})").config;
  EXPECT_EQ(adamw.optimizer.type, OptimizerType::kAdamW);
  EXPECT_TRUE(adamw.optimizer.decoupled_weight_decay());
  Config adam = parse_config(R"({"optimizer": {"type": "ADAM"}})").config;
  EXPECT_EQ(adam.optimizer.type, OptimizerType::kAdam);
  EXPECT_TRUE(adam.optimizer.decoupled_weight_decay());  // DeepSpeed: adam_w_mode defaults to true
  Config l2 =
      parse_config(R"({"optimizer": {"type": "Adam", "params": {"adam_w_mode": false}}})").config;
  EXPECT_FALSE(l2.optimizer.decoupled_weight_decay());
  ParsedConfig w =
      parse_config(R"({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": false}}})");
  EXPECT_TRUE(w.config.optimizer.decoupled_weight_decay());
  EXPECT_TRUE(has_issue(w.warnings, "optimizer.params.adam_w_mode", "no effect"));
}

TEST(ParseAccepted, LegacyZeroForms) {
  ParsedConfig b = parse_config(R"({"zero_optimization": true, "allgather_size": 1e7})");
  EXPECT_EQ(b.config.zero_optimization.stage, 1);
  EXPECT_EQ(b.config.zero_optimization.allgather_bucket_size, 10'000'000);
  EXPECT_TRUE(has_issue(b.warnings, "zero_optimization", "deprecated"));

  ParsedConfig legacy = parse_config(R"({"zero_optimization": {"stage": 3, "cpu_offload": true,
      "cpu_offload_param": true, "stage3_gather_fp16_weights_on_model_save": true}})");
  const ZeroConfig& z = legacy.config.zero_optimization;
  EXPECT_EQ(z.offload_optimizer.device, OffloadDevice::kCpu);
  EXPECT_EQ(z.offload_param.device, OffloadDevice::kCpu);
  EXPECT_TRUE(z.stage3_gather_16bit_weights_on_model_save);
  EXPECT_TRUE(has_issue(legacy.warnings, "zero_optimization.cpu_offload", "deprecated"))
      << dump(legacy.warnings);
  EXPECT_TRUE(has_issue(
      legacy.warnings, "zero_optimization.stage3_gather_fp16_weights_on_model_save", "deprecated"));
}

TEST(ParseAccepted, Stage3KeysWithoutPrefixAndBfloat16Section) {
  Config c = parse_config(R"({"zero_optimization": {"prefetch_bucket_size": 123,
      "param_persistence_threshold": 7, "max_live_parameters": 5, "max_reuse_distance": 6,
      "model_persistence_threshold": 8}, "bfloat16": {"enabled": true}})")
                 .config;
  EXPECT_EQ(c.zero_optimization.stage3_prefetch_bucket_size.value(), 123);
  EXPECT_EQ(c.zero_optimization.stage3_param_persistence_threshold.value(), 7);
  EXPECT_EQ(c.zero_optimization.stage3_max_live_parameters, 5);
  EXPECT_EQ(c.zero_optimization.stage3_max_reuse_distance, 6);
  EXPECT_EQ(c.zero_optimization.stage3_model_persistence_threshold, 8);
  EXPECT_TRUE(c.bf16.enabled.value());
}

TEST(ParseAccepted, AutoInsideDeepSpeedTypedSectionsMeansDefault) {
  // DeepSpeed drops "auto" keys in its typed sections, so their defaults apply; nothing fills
  // them, which each warning says.
  ParsedConfig p = parse_config(R"({"zero_optimization": {"stage": 3,
      "stage3_max_live_parameters": "auto", "overlap_comm": "auto"},
      "fp16": {"loss_scale_window": "auto"}})");
  ASSERT_EQ(p.warnings.size(), 3u) << dump(p.warnings);
  for (const char* key : {"zero_optimization.stage3_max_live_parameters",
                          "zero_optimization.overlap_comm", "fp16.loss_scale_window"})
    EXPECT_NE(dump(p.warnings).find(std::string(key) + ": \"auto\" takes the default"),
              std::string::npos)
        << key << "\n"
        << dump(p.warnings);
  EXPECT_EQ(p.config.zero_optimization.stage3_max_live_parameters, 1'000'000'000);
  EXPECT_TRUE(p.config.zero_optimization.overlap_comm);  // stage 3 default
  EXPECT_EQ(p.config.fp16.loss_scale_window, 1000);
}

TEST(ParseAccepted, OutcoreSection) {
  Config c = parse_config(R"({"outcore": {"device_memory_mb": 512, "swap_checksum": false,
      "metrics_file": "m.jsonl", "pinned_memory_mb": 64, "log_level": "DEBUG"}})")
                 .config;
  EXPECT_EQ(c.outcore.device_memory_mb, 512u);
  EXPECT_FALSE(c.outcore.swap_checksum);
  EXPECT_EQ(c.outcore.metrics_file, "m.jsonl");
  EXPECT_EQ(c.outcore.pinned_memory_mb, 64u);
  EXPECT_EQ(c.outcore.log_level, "debug");
}

TEST(ParseAccepted, NullMeansUnsetForOptionalKeys) {
  Config c = parse_config(R"({"train_batch_size": null, "steps_per_print": null,
      "activation_checkpointing": {"number_checkpoints": null}, "scheduler": null,
      "zero_optimization": {"offload_param": {"nvme_path": null}}})")
                 .config;
  EXPECT_TRUE(c.train_batch_size.is_unset());
  EXPECT_FALSE(c.steps_per_print.has_value());
  EXPECT_FALSE(c.activation_checkpointing.number_checkpoints.has_value());
  EXPECT_EQ(c.scheduler.type, SchedulerType::kNone);
}

TEST(ParseAccepted, SchedulerParams) {
  Config c = parse_config(R"({"scheduler": {"type": "OneCycle", "params": {
      "cycle_min_lr": 1e-5, "cycle_max_lr": 1e-3, "cycle_first_step_size": 100,
      "decay_step_size": 10, "decay_lr_rate": 0.1, "cycle_momentum": false}}})")
                 .config;
  ASSERT_EQ(c.scheduler.type, SchedulerType::kOneCycle);
  EXPECT_DOUBLE_EQ(*c.scheduler.one_cycle.cycle_min_lr, 1e-5);
  EXPECT_DOUBLE_EQ(*c.scheduler.one_cycle.cycle_max_lr, 1e-3);
  EXPECT_EQ(c.scheduler.one_cycle.cycle_first_step_size, 100);
  EXPECT_FALSE(c.scheduler.one_cycle.cycle_second_step_size.has_value());
  EXPECT_EQ(c.scheduler.one_cycle.decay_step_size, 10);
  EXPECT_FALSE(c.scheduler.one_cycle.cycle_momentum);

  Config cos = parse_config(R"({"scheduler": {"type": "WarmupCosineLR", "params": {
      "total_num_steps": 1000, "warmup_num_steps": 10, "cos_min_ratio": 0.1,
      "warmup_type": "linear"}}})")
                   .config;
  EXPECT_EQ(cos.scheduler.cosine.total_num_steps.value(), 1000);
  EXPECT_EQ(cos.scheduler.cosine.warmup_num_steps.value(), 10);
  EXPECT_DOUBLE_EQ(cos.scheduler.cosine.cos_min_ratio, 0.1);
  EXPECT_EQ(cos.scheduler.cosine.warmup_type, WarmupType::kLinear);
}

}  // namespace
}  // namespace outcore::config
