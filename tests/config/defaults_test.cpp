// The defaults of every section, as DeepSpeed 0.19.6 defines them (see
// shared/reference/deepspeed_facts.md), when the file leaves the section out.
#include <gtest/gtest.h>

#include "tests/config/config_test_util.hpp"

namespace outcore::config {
namespace {

Config empty_config() {
  ParsedConfig p = parse_config("{}");
  EXPECT_TRUE(p.warnings.empty());
  return p.config;
}

TEST(Defaults, TopLevel) {
  Config c = empty_config();
  EXPECT_TRUE(c.train_batch_size.is_unset());
  EXPECT_TRUE(c.train_micro_batch_size_per_gpu.is_unset());
  EXPECT_TRUE(c.gradient_accumulation_steps.is_unset());
  EXPECT_DOUBLE_EQ(c.gradient_clipping.value(), 1.0);  // 1.0 since DeepSpeed mid-2026
  EXPECT_FALSE(c.steps_per_print.has_value());
  EXPECT_FALSE(c.wall_clock_breakdown);
  EXPECT_FALSE(c.memory_breakdown);
  EXPECT_FALSE(c.prescale_gradients);
  EXPECT_DOUBLE_EQ(c.gradient_predivide_factor, 1.0);
  EXPECT_FALSE(c.zero_allow_untested_optimizer);
}

TEST(Defaults, Fp16) {
  FP16Config f = empty_config().fp16;
  EXPECT_FALSE(f.enabled.value());
  EXPECT_FALSE(f.auto_cast);
  EXPECT_DOUBLE_EQ(f.loss_scale, 0.0);
  EXPECT_TRUE(f.dynamic_loss_scale());
  EXPECT_EQ(f.initial_scale_power, 16);
  EXPECT_EQ(f.loss_scale_window, 1000);
  EXPECT_EQ(f.hysteresis, 2);
  EXPECT_FALSE(f.consecutive_hysteresis);
  EXPECT_DOUBLE_EQ(f.min_loss_scale, 1.0);
  EXPECT_FALSE(f.fp16_master_weights_and_grads);
  EXPECT_FALSE(parse_config(R"({"fp16": {"loss_scale": 128}})").config.fp16.dynamic_loss_scale());
}

TEST(Defaults, Bf16) {
  BF16Config b = empty_config().bf16;
  EXPECT_FALSE(b.enabled.value());
  EXPECT_FALSE(b.immediate_grad_update);
  EXPECT_TRUE(b.check_grad_overflow);
  EXPECT_FALSE(b.bf16_master_weights_and_grads);
  EXPECT_FALSE(b.bf16_optimizer_states);
}

TEST(Defaults, Optimizer) {
  // Absent section and a section with empty params give the same defaults.
  for (const char* text : {"{}", R"({"optimizer": {"type": "Adam", "params": {}}})"}) {
    OptimizerConfig o = parse_config(text).config.optimizer;
    EXPECT_EQ(o.type, OptimizerType::kAdam) << text;
    EXPECT_DOUBLE_EQ(o.lr.value(), 1e-3);
    EXPECT_DOUBLE_EQ(o.betas.value()[0], 0.9);
    EXPECT_DOUBLE_EQ(o.betas.value()[1], 0.999);
    EXPECT_DOUBLE_EQ(o.eps.value(), 1e-8);
    EXPECT_DOUBLE_EQ(o.weight_decay.value(), 0.0);
    EXPECT_TRUE(o.bias_correction);
    EXPECT_TRUE(o.adam_w_mode);
  }
}

TEST(Defaults, Scheduler) {
  EXPECT_EQ(empty_config().scheduler.type, SchedulerType::kNone);

  WarmupLRParams w = parse_config(R"({"scheduler": {"type": "WarmupLR"}})").config.scheduler.warmup;
  EXPECT_DOUBLE_EQ(w.warmup_min_lr.value(), 0.0);
  EXPECT_TRUE(w.warmup_max_lr.is_unset());  // the optimizer's lr, filled by resolve_auto
  EXPECT_EQ(w.warmup_num_steps.value(), 1000);
  EXPECT_EQ(w.warmup_type, WarmupType::kLog);

  WarmupLRParams d = parse_config(R"({"scheduler": {"type": "WarmupDecayLR",
      "params": {"total_num_steps": 10}}})")
                         .config.scheduler.warmup;
  EXPECT_DOUBLE_EQ(d.warmup_max_lr.value(), 0.001);  // WarmupDecayLR's own default
  EXPECT_EQ(d.total_num_steps.value(), 10);

  WarmupCosineLRParams c = parse_config(R"({"scheduler": {"type": "WarmupCosineLR",
      "params": {"total_num_steps": 10}}})")
                               .config.scheduler.cosine;
  EXPECT_DOUBLE_EQ(c.warmup_min_ratio, 0.0);
  EXPECT_EQ(c.warmup_num_steps.value(), 1000);
  EXPECT_DOUBLE_EQ(c.cos_min_ratio, 0.0001);
  EXPECT_EQ(c.warmup_type, WarmupType::kLog);

  OneCycleParams o = parse_config(R"({"scheduler": {"type": "OneCycle",
      "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1}}})")
                         .config.scheduler.one_cycle;
  EXPECT_DOUBLE_EQ(o.decay_lr_rate, 0.0);
  EXPECT_EQ(o.cycle_first_step_size, 2000);
  EXPECT_FALSE(o.cycle_second_step_size.has_value());
  EXPECT_EQ(o.cycle_first_stair_count, 0);
  EXPECT_FALSE(o.cycle_second_stair_count.has_value());
  EXPECT_EQ(o.decay_step_size, 0);
  EXPECT_TRUE(o.cycle_momentum);
  EXPECT_DOUBLE_EQ(o.cycle_min_mom, 0.8);
  EXPECT_DOUBLE_EQ(o.cycle_max_mom, 0.9);
  EXPECT_DOUBLE_EQ(o.decay_mom_rate, 0.0);
}

TEST(Defaults, ZeroOptimization) {
  ZeroConfig z = empty_config().zero_optimization;
  EXPECT_EQ(z.stage, 0);
  EXPECT_TRUE(z.contiguous_gradients);
  EXPECT_TRUE(z.reduce_scatter);
  EXPECT_EQ(z.reduce_bucket_size.value(), 500'000'000);
  EXPECT_TRUE(z.allgather_partitions);
  EXPECT_EQ(z.allgather_bucket_size, 500'000'000);
  EXPECT_FALSE(z.overlap_comm);
  EXPECT_TRUE(z.load_from_fp32_weights);
  EXPECT_FALSE(z.elastic_checkpoint);
  EXPECT_EQ(z.sub_group_size, 1'000'000'000);
  EXPECT_EQ(z.stage3_prefetch_bucket_size.value(), 50'000'000);
  EXPECT_EQ(z.stage3_param_persistence_threshold.value(), 100'000);
  EXPECT_EQ(z.stage3_model_persistence_threshold, std::numeric_limits<int64_t>::max());
  EXPECT_EQ(z.stage3_max_live_parameters, 1'000'000'000);
  EXPECT_EQ(z.stage3_max_reuse_distance, 1'000'000'000);
  EXPECT_FALSE(z.stage3_gather_16bit_weights_on_model_save);
  EXPECT_EQ(z.stage3_module_granularity_threshold, 0);
  EXPECT_FALSE(z.stage3_use_all_reduce_for_fetch_params);
  EXPECT_FALSE(z.stage3_allgather_sequential);
  EXPECT_FALSE(z.round_robin_gradients);
  EXPECT_TRUE(z.ignore_unused_parameters);
  EXPECT_TRUE(z.use_multi_rank_bucket_allreduce);
  EXPECT_EQ(z.mics_shard_size, -1);
  EXPECT_EQ(z.zero_hpz_partition_size, 1);
  EXPECT_FALSE(z.zero_quantized_weights);
  EXPECT_FALSE(z.zero_quantized_gradients);
  EXPECT_FALSE(z.zero_quantized_nontrainable_weights);
}

TEST(Defaults, OverlapCommFollowsStage) {
  for (int stage = 0; stage <= 3; ++stage) {
    std::string text = R"({"zero_optimization": {"stage": )" + std::to_string(stage) + "}}";
    EXPECT_EQ(parse_config(text).config.zero_optimization.overlap_comm, stage == 3) << stage;
  }
  EXPECT_FALSE(parse_config(R"({"zero_optimization": {"stage": 3, "overlap_comm": false}})")
                   .config.zero_optimization.overlap_comm);
}

TEST(Defaults, OffloadParam) {
  for (const char* text : {"{}", R"({"zero_optimization": {"stage": 3, "offload_param": {}}})"}) {
    OffloadParamConfig o = parse_config(text).config.zero_optimization.offload_param;
    EXPECT_EQ(o.device, OffloadDevice::kNone) << text;
    EXPECT_TRUE(o.nvme_path.empty());
    EXPECT_EQ(o.buffer_count, 5);
    EXPECT_EQ(o.buffer_size, 100'000'000);
    EXPECT_EQ(o.max_in_cpu, 1'000'000'000);
    EXPECT_TRUE(o.pin_memory);  // true since DeepSpeed 2026-08
  }
}

TEST(Defaults, OffloadOptimizer) {
  for (const char* text :
       {"{}", R"({"zero_optimization": {"stage": 3, "offload_optimizer": {}}})"}) {
    OffloadOptimizerConfig o = parse_config(text).config.zero_optimization.offload_optimizer;
    EXPECT_EQ(o.device, OffloadDevice::kNone) << text;
    EXPECT_TRUE(o.nvme_path.empty());
    EXPECT_EQ(o.buffer_count, 4);
    EXPECT_TRUE(o.pin_memory);
    EXPECT_FALSE(o.pipeline_read);
    EXPECT_FALSE(o.pipeline_write);
    EXPECT_FALSE(o.fast_init);
    EXPECT_DOUBLE_EQ(o.ratio, 1.0);
    EXPECT_DOUBLE_EQ(o.cpuadam_cores_perc, 1.0);  // every hardware thread
  }
}

TEST(Defaults, Aio) {
  AioConfig a = empty_config().aio;
  EXPECT_EQ(a.block_size, 1'048'576);
  EXPECT_EQ(a.queue_depth, 8);
  EXPECT_EQ(a.intra_op_parallelism, 1);
  EXPECT_FALSE(a.single_submit);
  EXPECT_TRUE(a.overlap_events);
  EXPECT_FALSE(a.use_gds);
}

TEST(Defaults, ActivationCheckpointing) {
  ActivationCheckpointingConfig a = empty_config().activation_checkpointing;
  EXPECT_FALSE(a.partition_activations);
  EXPECT_FALSE(a.cpu_checkpointing);
  EXPECT_FALSE(a.contiguous_memory_optimization);
  EXPECT_FALSE(a.number_checkpoints.has_value());
  EXPECT_FALSE(a.synchronize_checkpoint_boundary);
  EXPECT_FALSE(a.profile);
}

TEST(Defaults, Outcore) {
  OutcoreConfig o = empty_config().outcore;
  EXPECT_EQ(o.device_memory_mb, 0u);
  EXPECT_TRUE(o.swap_checksum);
  EXPECT_TRUE(o.metrics_file.empty());
  EXPECT_EQ(o.pinned_memory_mb, 0u);
  EXPECT_EQ(o.log_level, "info");
}

TEST(Defaults, PrintedWithEverySection) {
  nlohmann::ordered_json j = to_json(empty_config());
  for (const char* section : {"fp16", "bf16", "optimizer", "zero_optimization", "aio",
                              "activation_checkpointing", "outcore"}) {
    ASSERT_TRUE(j.contains(section)) << section;
    EXPECT_TRUE(j[section].is_object()) << section;
  }
  EXPECT_TRUE(j["scheduler"].is_null());
  EXPECT_EQ(j["zero_optimization"]["offload_param"]["buffer_count"], 5);
  EXPECT_EQ(j["zero_optimization"]["offload_optimizer"]["device"], "none");
  EXPECT_EQ(j["aio"]["block_size"], 1048576);
  EXPECT_EQ(j["gradient_clipping"], 1.0);
  EXPECT_TRUE(j["train_batch_size"].is_null());
}

}  // namespace
}  // namespace outcore::config
