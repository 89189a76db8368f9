// Config -> DeepSpeed-compatible JSON with every section and its effective values.
#include "engine/config/config.hpp"

namespace outcore::config {
namespace {

using Json = nlohmann::ordered_json;

template <typename T>
Json value(const AutoOr<T>& v) {
  if (v.is_auto()) return "auto";
  if (v.is_unset()) return nullptr;
  return Json(v.value());
}

template <typename T>
Json value(const std::optional<T>& v) {
  return v ? Json(*v) : Json(nullptr);
}

Json path_or_null(const std::string& p) { return p.empty() ? Json(nullptr) : Json(p); }

Json fp16_json(const FP16Config& f) {
  return {{"enabled", value(f.enabled)},
          {"auto_cast", f.auto_cast},
          {"loss_scale", f.loss_scale},
          {"initial_scale_power", f.initial_scale_power},
          {"loss_scale_window", f.loss_scale_window},
          {"hysteresis", f.hysteresis},
          {"consecutive_hysteresis", f.consecutive_hysteresis},
          {"min_loss_scale", f.min_loss_scale},
          {"fp16_master_weights_and_grads", f.fp16_master_weights_and_grads}};
}

Json bf16_json(const BF16Config& b) {
  return {{"enabled", value(b.enabled)},
          {"immediate_grad_update", b.immediate_grad_update},
          {"check_grad_overflow", b.check_grad_overflow},
          {"bf16_master_weights_and_grads", b.bf16_master_weights_and_grads},
          {"bf16_optimizer_states", b.bf16_optimizer_states}};
}

Json optimizer_json(const OptimizerConfig& o) {
  return {{"type", to_string(o.type)},
          {"params",
           {{"lr", value(o.lr)},
            {"betas", value(o.betas)},
            {"eps", value(o.eps)},
            {"weight_decay", value(o.weight_decay)},
            {"bias_correction", o.bias_correction},
            {"adam_w_mode", o.adam_w_mode},
            {"fp32_optimizer_states", o.fp32_optimizer_states}}}};
}

Json scheduler_params_json(const SchedulerConfig& s) {
  switch (s.type) {
    case SchedulerType::kWarmupLR:
    case SchedulerType::kWarmupDecayLR: {
      const WarmupLRParams& w = s.warmup;
      Json p = {{"warmup_min_lr", value(w.warmup_min_lr)},
                {"warmup_max_lr", value(w.warmup_max_lr)},
                {"warmup_num_steps", value(w.warmup_num_steps)},
                {"warmup_type", to_string(w.warmup_type)}};
      if (s.type == SchedulerType::kWarmupDecayLR) p["total_num_steps"] = value(w.total_num_steps);
      return p;
    }
    case SchedulerType::kWarmupCosineLR: {
      const WarmupCosineLRParams& c = s.cosine;
      return {{"total_num_steps", value(c.total_num_steps)},
              {"warmup_min_ratio", c.warmup_min_ratio},
              {"warmup_num_steps", value(c.warmup_num_steps)},
              {"cos_min_ratio", c.cos_min_ratio},
              {"warmup_type", to_string(c.warmup_type)}};
    }
    case SchedulerType::kOneCycle: {
      const OneCycleParams& c = s.one_cycle;
      return {{"cycle_min_lr", value(c.cycle_min_lr)},
              {"cycle_max_lr", value(c.cycle_max_lr)},
              {"decay_lr_rate", c.decay_lr_rate},
              {"cycle_first_step_size", c.cycle_first_step_size},
              {"cycle_second_step_size", value(c.cycle_second_step_size)},
              {"cycle_first_stair_count", c.cycle_first_stair_count},
              {"cycle_second_stair_count", value(c.cycle_second_stair_count)},
              {"decay_step_size", c.decay_step_size},
              {"cycle_momentum", c.cycle_momentum},
              {"cycle_min_mom", c.cycle_min_mom},
              {"cycle_max_mom", c.cycle_max_mom},
              {"decay_mom_rate", c.decay_mom_rate}};
    }
    case SchedulerType::kNone:
      break;
  }
  return nullptr;
}

Json scheduler_json(const SchedulerConfig& s) {
  if (s.type == SchedulerType::kNone) return nullptr;
  return {{"type", to_string(s.type)}, {"params", scheduler_params_json(s)}};
}

Json offload_param_json(const OffloadParamConfig& o) {
  return {{"device", to_string(o.device)},  {"nvme_path", path_or_null(o.nvme_path)},
          {"buffer_count", o.buffer_count}, {"buffer_size", o.buffer_size},
          {"max_in_cpu", o.max_in_cpu},     {"pin_memory", o.pin_memory}};
}

Json offload_optimizer_json(const OffloadOptimizerConfig& o) {
  return {{"device", to_string(o.device)},
          {"nvme_path", path_or_null(o.nvme_path)},
          {"buffer_count", o.buffer_count},
          {"pin_memory", o.pin_memory},
          {"pipeline_read", o.pipeline_read},
          {"pipeline_write", o.pipeline_write},
          {"fast_init", o.fast_init},
          {"ratio", o.ratio},
          {"cpuadam_cores_perc", o.cpuadam_cores_perc}};
}

Json zero_json(const ZeroConfig& z) {
  return {
      {"stage", z.stage},
      {"contiguous_gradients", z.contiguous_gradients},
      {"reduce_scatter", z.reduce_scatter},
      {"reduce_bucket_size", value(z.reduce_bucket_size)},
      {"allgather_partitions", z.allgather_partitions},
      {"allgather_bucket_size", z.allgather_bucket_size},
      {"overlap_comm", z.overlap_comm},
      {"load_from_fp32_weights", z.load_from_fp32_weights},
      {"elastic_checkpoint", z.elastic_checkpoint},
      {"sub_group_size", z.sub_group_size},
      {"stage3_prefetch_bucket_size", value(z.stage3_prefetch_bucket_size)},
      {"stage3_param_persistence_threshold", value(z.stage3_param_persistence_threshold)},
      {"stage3_model_persistence_threshold", z.stage3_model_persistence_threshold},
      {"stage3_max_live_parameters", z.stage3_max_live_parameters},
      {"stage3_max_reuse_distance", z.stage3_max_reuse_distance},
      {"stage3_gather_16bit_weights_on_model_save", z.stage3_gather_16bit_weights_on_model_save},
      {"stage3_module_granularity_threshold", z.stage3_module_granularity_threshold},
      {"stage3_use_all_reduce_for_fetch_params", z.stage3_use_all_reduce_for_fetch_params},
      {"stage3_allgather_sequential", z.stage3_allgather_sequential},
      {"round_robin_gradients", z.round_robin_gradients},
      {"ignore_unused_parameters", z.ignore_unused_parameters},
      {"use_multi_rank_bucket_allreduce", z.use_multi_rank_bucket_allreduce},
      {"mics_shard_size", z.mics_shard_size},
      {"zero_hpz_partition_size", z.zero_hpz_partition_size},
      {"zero_quantized_weights", z.zero_quantized_weights},
      {"zero_quantized_gradients", z.zero_quantized_gradients},
      {"zero_quantized_nontrainable_weights", z.zero_quantized_nontrainable_weights},
      {"offload_param", offload_param_json(z.offload_param)},
      {"offload_optimizer", offload_optimizer_json(z.offload_optimizer)}};
}

Json aio_json(const AioConfig& a) {
  return {{"block_size", a.block_size},
          {"queue_depth", a.queue_depth},
          {"intra_op_parallelism", a.intra_op_parallelism},
          {"single_submit", a.single_submit},
          {"overlap_events", a.overlap_events},
          {"use_gds", a.use_gds}};
}

Json activation_checkpointing_json(const ActivationCheckpointingConfig& a) {
  return {{"partition_activations", a.partition_activations},
          {"cpu_checkpointing", a.cpu_checkpointing},
          {"contiguous_memory_optimization", a.contiguous_memory_optimization},
          {"number_checkpoints", value(a.number_checkpoints)},
          {"synchronize_checkpoint_boundary", a.synchronize_checkpoint_boundary},
          {"profile", a.profile}};
}

Json outcore_json(const OutcoreConfig& o) {
  return {{"device_memory_mb", o.device_memory_mb},
          {"swap_checksum", o.swap_checksum},
          {"metrics_file", path_or_null(o.metrics_file)},
          {"pinned_memory_mb", o.pinned_memory_mb},
          {"log_level", o.log_level},
          {"step_in_backward", o.step_in_backward},
          {"compute_dtype", o.compute_dtype}};
}

}  // namespace

nlohmann::ordered_json to_json(const Config& c) {
  Json j;
  j["train_batch_size"] = value(c.train_batch_size);
  j["train_micro_batch_size_per_gpu"] = value(c.train_micro_batch_size_per_gpu);
  j["gradient_accumulation_steps"] = value(c.gradient_accumulation_steps);
  j["gradient_clipping"] = value(c.gradient_clipping);
  j["steps_per_print"] = value(c.steps_per_print);
  j["wall_clock_breakdown"] = c.wall_clock_breakdown;
  j["memory_breakdown"] = c.memory_breakdown;
  j["prescale_gradients"] = c.prescale_gradients;
  j["gradient_predivide_factor"] = c.gradient_predivide_factor;
  j["zero_allow_untested_optimizer"] = c.zero_allow_untested_optimizer;
  j["fp16"] = fp16_json(c.fp16);
  j["bf16"] = bf16_json(c.bf16);
  j["optimizer"] = optimizer_json(c.optimizer);
  j["scheduler"] = scheduler_json(c.scheduler);
  j["zero_optimization"] = zero_json(c.zero_optimization);
  j["aio"] = aio_json(c.aio);
  j["activation_checkpointing"] = activation_checkpointing_json(c.activation_checkpointing);
  j["outcore"] = outcore_json(c.outcore);
  return j;
}

}  // namespace outcore::config
