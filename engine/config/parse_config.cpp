// DeepSpeed JSON text -> Config: one reader per section, every problem collected.
#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <limits>
#include <memory>
#include <unordered_map>

#include "common/log.hpp"
#include "engine/config/config.hpp"
#include "engine/config/lenient_json.hpp"
#include "engine/config/section_reader.hpp"

namespace outcore::config {
namespace {

using detail::Diagnostics;
using detail::IntRange;
using detail::Json;
using detail::RealRange;
using detail::SectionReader;
using detail::show;

constexpr double kInf = std::numeric_limits<double>::infinity();
const IntRange kPositive{1};
const IntRange kNonNegative{0};
const RealRange kNonNegativeReal{0};
const RealRange kPositiveReal{0, kInf, true};
const RealRange kUnitInterval{0, 1};

// The object at `key` of `parent`, or nullptr when absent or null. Anything else that is
// not an object is an error.
const Json* object_at(SectionReader& parent, std::string_view key) {
  const Json* v = parent.take(key);
  if (!v || v->is_null()) return nullptr;
  if (!v->is_object()) {
    parent.diagnostics().error(parent.key_path(key), "got " + show(*v) + "; allowed: an object");
    return nullptr;
  }
  return v;
}

void read_fp16(SectionReader& root, Diagnostics& d, FP16Config& f) {
  SectionReader s(object_at(root, "fp16"), "fp16", d, /*auto_means_default=*/true);
  s.get_auto("enabled", f.enabled);
  s.get("auto_cast", f.auto_cast);
  s.get("loss_scale", f.loss_scale, kNonNegativeReal);
  s.get("initial_scale_power", f.initial_scale_power, IntRange{0, 63});
  s.get("loss_scale_window", f.loss_scale_window, kPositive);
  s.get("hysteresis", f.hysteresis, kPositive);
  s.get("consecutive_hysteresis", f.consecutive_hysteresis);
  s.get("min_loss_scale", f.min_loss_scale, kPositiveReal);
  s.get("fp16_master_weights_and_grads", f.fp16_master_weights_and_grads);
  s.finish();
}

void read_bf16(SectionReader& root, Diagnostics& d, BF16Config& b) {
  auto [v, name] = root.take_one_of({"bf16", "bfloat16"});
  const Json* obj = v && !v->is_null() ? object_at(root, name) : nullptr;
  SectionReader s(obj, name.empty() ? "bf16" : name, d, /*auto_means_default=*/true);
  s.get_auto("enabled", b.enabled);
  s.get("immediate_grad_update", b.immediate_grad_update);
  s.get("check_grad_overflow", b.check_grad_overflow);
  s.get("bf16_master_weights_and_grads", b.bf16_master_weights_and_grads);
  s.get("bf16_optimizer_states", b.bf16_optimizer_states);
  s.finish();
  if (b.bf16_optimizer_states && !b.bf16_master_weights_and_grads) {
    d.error(s.key_path("bf16_optimizer_states"),
            "true requires bf16_master_weights_and_grads: true; allowed: false here");
  }
}

void read_betas(SectionReader& p, AutoOr<std::array<double, 2>>& betas) {
  const Json* v = p.take("betas");
  if (!v) return;
  if (detail::is_auto_string(*v)) {
    betas.set_auto();
    return;
  }
  if (v->is_array() && v->size() == 2 && (*v)[0].is_number() && (*v)[1].is_number()) {
    std::array<double, 2> b{(*v)[0].get<double>(), (*v)[1].get<double>()};
    if (b[0] >= 0 && b[0] < 1 && b[1] >= 0 && b[1] < 1) {
      betas.set(b);
      return;
    }
  }
  p.diagnostics().error(p.key_path("betas"), "got " + show(*v) +
                                                 "; allowed: [beta1, beta2] with each in [0, 1), "
                                                 "or \"auto\"");
}

void read_optimizer(SectionReader& root, Diagnostics& d, OptimizerConfig& o) {
  const Json* obj = object_at(root, "optimizer");
  if (!obj) return;
  SectionReader s(obj, "optimizer", d, /*auto_means_default=*/false);
  const char* allowed =
      "allowed: \"Adam\" or \"AdamW\" (outcore implements only these two; other DeepSpeed "
      "and torch.optim optimizers are not supported)";
  const Json* type = s.take("type");
  if (!type) {
    d.error("optimizer.type", std::string("missing; ") + allowed);
  } else if (type->is_string() && detail::lower(type->get<std::string>()) == "adam") {
    o.type = OptimizerType::kAdam;
  } else if (type->is_string() && detail::lower(type->get<std::string>()) == "adamw") {
    o.type = OptimizerType::kAdamW;
  } else {
    d.error("optimizer.type", "got " + show(*type) + "; " + allowed);
  }
  s.ignore("legacy_fusion", false);

  SectionReader p(object_at(s, "params"), "optimizer.params", d, /*auto_means_default=*/false);
  p.get_auto("lr", o.lr, kNonNegativeReal);
  read_betas(p, o.betas);
  p.get_auto("eps", o.eps, kPositiveReal);
  p.get_auto("weight_decay", o.weight_decay, kNonNegativeReal);
  p.get("bias_correction", o.bias_correction);
  if (p.get("adam_w_mode", o.adam_w_mode) && !o.adam_w_mode && o.type == OptimizerType::kAdamW) {
    d.warn("optimizer.params.adam_w_mode",
           "false has no effect with type AdamW (weight decay stays decoupled)");
  }
  p.ignore("torch_adam", false);
  p.ignore("fp32_optimizer_states", true);
  bool amsgrad = false;
  if (p.get("amsgrad", amsgrad) && amsgrad) {
    d.error("optimizer.params.amsgrad",
            "got true; allowed: false (DeepSpeed's Adam has no "
            "AMSGrad either)");
  }
  if (p.take("max_grad_norm")) {
    d.error("optimizer.params.max_grad_norm",
            "not accepted here (DeepSpeed rejects it too); set the top-level "
            "\"gradient_clipping\" instead");
  }
  p.finish();
  s.finish();
}

void read_warmup_type(SectionReader& p, WarmupType& t) {
  p.get_enum("warmup_type", t, {{"log", WarmupType::kLog}, {"linear", WarmupType::kLinear}});
}

void require(SectionReader& p, bool missing, std::string_view key, std::string_view type,
             const std::string& allowed) {
  if (!missing) return;
  p.diagnostics().error(p.key_path(key),
                        "missing; required by " + std::string(type) + "; allowed: " + allowed);
}

void read_warmup_lr(SectionReader& p, SchedulerType type, WarmupLRParams& w) {
  p.get_auto("warmup_min_lr", w.warmup_min_lr, kNonNegativeReal);
  p.get_auto("warmup_max_lr", w.warmup_max_lr, kNonNegativeReal);
  p.get_auto("warmup_num_steps", w.warmup_num_steps, kPositive);
  read_warmup_type(p, w.warmup_type);
  p.ignore("last_batch_iteration", -1);
  if (type == SchedulerType::kWarmupDecayLR) {
    p.get_auto("total_num_steps", w.total_num_steps, kPositive);
    require(p, w.total_num_steps.is_unset(), "total_num_steps", "WarmupDecayLR",
            "an integer >= 1 or \"auto\"");
    // DeepSpeed's WarmupDecayLR signature defaults warmup_max_lr to 0.001, unlike WarmupLR.
    if (w.warmup_max_lr.is_unset()) w.warmup_max_lr.set(0.001);
  }
}

void read_warmup_cosine(SectionReader& p, WarmupCosineLRParams& c) {
  p.get_auto("total_num_steps", c.total_num_steps, kPositive);
  require(p, c.total_num_steps.is_unset(), "total_num_steps", "WarmupCosineLR",
          "an integer >= 1 or \"auto\"");
  p.get("warmup_min_ratio", c.warmup_min_ratio, kUnitInterval);
  p.get_auto("warmup_num_steps", c.warmup_num_steps, kPositive);
  p.get("cos_min_ratio", c.cos_min_ratio, kUnitInterval);
  read_warmup_type(p, c.warmup_type);
  p.ignore("last_batch_iteration", -1);
}

void read_one_cycle(SectionReader& p, OneCycleParams& c) {
  p.get("cycle_min_lr", c.cycle_min_lr, kNonNegativeReal);
  p.get("cycle_max_lr", c.cycle_max_lr, kNonNegativeReal);
  require(p, !c.cycle_min_lr, "cycle_min_lr", "OneCycle", "a number >= 0");
  require(p, !c.cycle_max_lr, "cycle_max_lr", "OneCycle", "a number >= 0");
  if (c.cycle_min_lr && c.cycle_max_lr && *c.cycle_max_lr < *c.cycle_min_lr) {
    p.diagnostics().error(p.key_path("cycle_max_lr"), "got " + Json(*c.cycle_max_lr).dump() +
                                                          "; allowed: a number >= cycle_min_lr (" +
                                                          Json(*c.cycle_min_lr).dump() + ")");
  }
  p.get("decay_lr_rate", c.decay_lr_rate, kNonNegativeReal);
  p.get("cycle_first_step_size", c.cycle_first_step_size, kPositive);
  p.get("cycle_second_step_size", c.cycle_second_step_size, kPositive);
  p.get("cycle_first_stair_count", c.cycle_first_stair_count, kNonNegative);
  p.get("cycle_second_stair_count", c.cycle_second_stair_count, kNonNegative);
  p.get("decay_step_size", c.decay_step_size, kNonNegative);
  p.get("cycle_momentum", c.cycle_momentum);
  p.get("cycle_min_mom", c.cycle_min_mom, RealRange{0, 1, false, true});
  p.get("cycle_max_mom", c.cycle_max_mom, RealRange{0, 1, false, true});
  if (c.cycle_max_mom < c.cycle_min_mom) {
    p.diagnostics().error(p.key_path("cycle_max_mom"),
                          "got " + Json(c.cycle_max_mom).dump() +
                              "; allowed: a number >= cycle_min_mom (" +
                              Json(c.cycle_min_mom).dump() + ")");
  }
  p.get("decay_mom_rate", c.decay_mom_rate, kNonNegativeReal);
  p.ignore("last_batch_iteration", -1);
}

void read_scheduler(SectionReader& root, Diagnostics& d, SchedulerConfig& sc) {
  const Json* obj = object_at(root, "scheduler");
  if (!obj) return;
  SectionReader s(obj, "scheduler", d, /*auto_means_default=*/false);
  const char* allowed =
      "allowed: \"WarmupLR\", \"WarmupDecayLR\", \"WarmupCosineLR\" or \"OneCycle\"";
  const Json* type = s.take("type");
  std::optional<SchedulerType> t;
  if (type && type->is_string()) {
    std::string name = detail::lower(type->get<std::string>());
    for (SchedulerType c : {SchedulerType::kWarmupLR, SchedulerType::kWarmupDecayLR,
                            SchedulerType::kWarmupCosineLR, SchedulerType::kOneCycle}) {
      if (detail::lower(to_string(c)) == name) t = c;
    }
  }
  if (!type) d.error("scheduler.type", std::string("missing; ") + allowed);
  if (type && !t) d.error("scheduler.type", "got " + show(*type) + "; " + allowed);

  SectionReader p(object_at(s, "params"), "scheduler.params", d, /*auto_means_default=*/false);
  s.finish();
  if (!t) return;  // params of an unknown type cannot be checked
  sc.type = *t;
  switch (*t) {
    case SchedulerType::kWarmupLR:
    case SchedulerType::kWarmupDecayLR:
      read_warmup_lr(p, *t, sc.warmup);
      break;
    case SchedulerType::kWarmupCosineLR:
      read_warmup_cosine(p, sc.cosine);
      break;
    case SchedulerType::kOneCycle:
      read_one_cycle(p, sc.one_cycle);
      break;
    case SchedulerType::kNone:
      break;
  }
  p.finish();
}

void read_offload_common(SectionReader& s, OffloadDevice& device, std::string& nvme_path,
                         int64_t& buffer_count, bool& pin_memory) {
  s.get_enum("device", device,
             {{"none", OffloadDevice::kNone},
              {"cpu", OffloadDevice::kCpu},
              {"nvme", OffloadDevice::kNvme}});
  s.get("nvme_path", nvme_path, /*null_is_empty=*/true);
  s.get("buffer_count", buffer_count, kPositive);
  s.get("pin_memory", pin_memory);
  if (device == OffloadDevice::kNvme && nvme_path.empty()) {
    s.diagnostics().error(s.key_path("nvme_path"),
                          "missing; required when device is \"nvme\"; allowed: the path of a "
                          "directory on the NVMe drive for swap files");
  }
}

// Returns whether the section was present in the file.
bool read_offload_param(SectionReader& z, Diagnostics& d, OffloadParamConfig& o) {
  const Json* obj = object_at(z, "offload_param");
  SectionReader s(obj, "zero_optimization.offload_param", d, /*auto_means_default=*/true);
  read_offload_common(s, o.device, o.nvme_path, o.buffer_count, o.pin_memory);
  s.get("buffer_size", o.buffer_size, kPositive);
  s.get("max_in_cpu", o.max_in_cpu, kNonNegative);
  s.finish();
  return obj != nullptr;
}

bool read_offload_optimizer(SectionReader& z, Diagnostics& d, OffloadOptimizerConfig& o) {
  const Json* obj = object_at(z, "offload_optimizer");
  SectionReader s(obj, "zero_optimization.offload_optimizer", d, /*auto_means_default=*/true);
  read_offload_common(s, o.device, o.nvme_path, o.buffer_count, o.pin_memory);
  s.get("pipeline_read", o.pipeline_read);
  s.get("pipeline_write", o.pipeline_write);
  s.get("fast_init", o.fast_init);
  s.get("ratio", o.ratio, kUnitInterval);
  s.ignore("super_offload", false);
  s.ignore("cpuadam_cores_perc", 0.8);
  s.finish();
  return obj != nullptr;
}

// Legacy booleans cpu_offload / cpu_offload_param: true means device "cpu".
void read_legacy_offload(SectionReader& z, std::string_view key, bool section_given,
                         std::string_view section, OffloadDevice& device) {
  bool on = false;
  if (!z.get(key, on)) return;
  Diagnostics& d = z.diagnostics();
  if (section_given) {
    d.error(z.key_path(key), "given together with " + std::string(section) +
                                 " (it is the deprecated name of " + std::string(section) +
                                 ".device \"cpu\"); keep " + std::string(section));
    return;
  }
  d.warn(z.key_path(key), "deprecated; use " + std::string(section) + ": {\"device\": \"cpu\"}");
  if (on) device = OffloadDevice::kCpu;
}

void warn_unimplemented_zero(SectionReader& z, const ZeroConfig& zc) {
  auto warn = [&](std::string_view key, bool is_default) {
    if (!is_default) {
      z.diagnostics().warn(z.key_path(key),
                           "outcore does not implement this DeepSpeed feature; ignored");
    }
  };
  warn("mics_shard_size", zc.mics_shard_size <= 0);
  warn("zero_hpz_partition_size", zc.zero_hpz_partition_size == 1);
  warn("zero_quantized_weights", !zc.zero_quantized_weights);
  warn("zero_quantized_gradients", !zc.zero_quantized_gradients);
  warn("zero_quantized_nontrainable_weights", !zc.zero_quantized_nontrainable_weights);
}

// The stage3_* keys are also accepted without their prefix, as DeepSpeed does.
template <typename Read>
void read_aliased(SectionReader& z, std::string_view stage3_name, Read read) {
  std::string plain(stage3_name.substr(std::string_view("stage3_").size()));
  auto [v, name] = z.take_one_of({stage3_name, plain});
  if (v) read(std::string_view(name));
}

void read_stage3_keys(SectionReader& z, ZeroConfig& zc) {
  read_aliased(z, "stage3_prefetch_bucket_size", [&](std::string_view k) {
    z.get_auto(k, zc.stage3_prefetch_bucket_size, kNonNegative);
  });
  read_aliased(z, "stage3_param_persistence_threshold", [&](std::string_view k) {
    z.get_auto(k, zc.stage3_param_persistence_threshold, kNonNegative);
  });
  read_aliased(z, "stage3_model_persistence_threshold", [&](std::string_view k) {
    z.get(k, zc.stage3_model_persistence_threshold, kNonNegative);
  });
  read_aliased(z, "stage3_max_live_parameters",
               [&](std::string_view k) { z.get(k, zc.stage3_max_live_parameters, kNonNegative); });
  read_aliased(z, "stage3_max_reuse_distance",
               [&](std::string_view k) { z.get(k, zc.stage3_max_reuse_distance, kNonNegative); });
  read_aliased(z, "stage3_module_granularity_threshold", [&](std::string_view k) {
    z.get(k, zc.stage3_module_granularity_threshold, kNonNegative);
  });
  read_aliased(z, "stage3_use_all_reduce_for_fetch_params",
               [&](std::string_view k) { z.get(k, zc.stage3_use_all_reduce_for_fetch_params); });
  read_aliased(z, "stage3_allgather_sequential",
               [&](std::string_view k) { z.get(k, zc.stage3_allgather_sequential); });
  auto [v, name] = z.take_one_of({"stage3_gather_16bit_weights_on_model_save",
                                  "gather_16bit_weights_on_model_save",
                                  "stage3_gather_fp16_weights_on_model_save"});
  if (v) {
    z.get(name, zc.stage3_gather_16bit_weights_on_model_save);
    if (name == "stage3_gather_fp16_weights_on_model_save") {
      z.diagnostics().warn(z.key_path(name),
                           "deprecated; use stage3_gather_16bit_weights_on_model_save");
    }
  }
}

void check_offload_stage(Diagnostics& d, const ZeroConfig& zc) {
  const std::string stage = std::to_string(zc.stage);
  if (zc.offload_param.device != OffloadDevice::kNone && zc.stage < 3) {
    d.warn(
        "zero_optimization.offload_param.device",
        "offload_param works only with stage 3; ignored at stage " + stage + " (as in DeepSpeed)");
  }
  const OffloadOptimizerConfig& oo = zc.offload_optimizer;
  if (oo.device != OffloadDevice::kNone && zc.stage == 0) {
    d.warn("zero_optimization.offload_optimizer.device",
           "offload_optimizer needs stage 1, 2 or 3; ignored at stage 0");
  } else if (oo.device == OffloadDevice::kNvme && zc.stage < 3) {
    d.warn("zero_optimization.offload_optimizer.device",
           "at stage " + stage +
               " optimizer state stays in host memory as with \"cpu\" (as in DeepSpeed); "
               "swapping it to NVMe needs stage 3");
  }
  if (oo.ratio < 1.0 && zc.stage != 3) {
    d.error("zero_optimization.offload_optimizer.ratio",
            "got " + Json(oo.ratio).dump() + " at stage " + stage +
                "; allowed: 1.0 below stage 3 (partial offload needs stage 3)");
  }
}

void read_zero(SectionReader& root, Diagnostics& d, ZeroConfig& zc) {
  const Json* legacy_allgather_size = root.take("allgather_size");
  const Json* v = root.take("zero_optimization");
  if (v && v->is_boolean()) {
    // Legacy form: true means stage 1, with the top-level allgather_size as bucket size.
    zc.stage = v->get<bool>() ? 1 : 0;
    d.warn("zero_optimization",
           "boolean form is deprecated; use {\"stage\": " + std::to_string(zc.stage) + "}");
    if (legacy_allgather_size) {
      auto x = detail::to_int(*legacy_allgather_size, "allgather_size", kNonNegative, d);
      if (x) zc.allgather_bucket_size = *x;
    }
    return;
  }
  if (legacy_allgather_size) {
    d.warn("allgather_size", "only used with the legacy \"zero_optimization\": true; ignored");
  }
  const Json* obj = object_at(root, "zero_optimization");
  SectionReader z(obj, "zero_optimization", d, /*auto_means_default=*/true);
  size_t errors_before = d.errors.size();
  z.get("stage", zc.stage, IntRange{0, 3});
  bool stage_valid = d.errors.size() == errors_before;
  z.get("contiguous_gradients", zc.contiguous_gradients);
  z.get("reduce_scatter", zc.reduce_scatter);
  z.get_auto("reduce_bucket_size", zc.reduce_bucket_size, kNonNegative);
  z.get("allgather_partitions", zc.allgather_partitions);
  z.get("allgather_bucket_size", zc.allgather_bucket_size, kNonNegative);
  bool overlap = false;
  zc.overlap_comm = z.get("overlap_comm", overlap) ? overlap : zc.stage == 3;
  z.get("load_from_fp32_weights", zc.load_from_fp32_weights);
  z.get("elastic_checkpoint", zc.elastic_checkpoint);
  z.get("sub_group_size", zc.sub_group_size, kPositive);
  read_stage3_keys(z, zc);
  z.get("round_robin_gradients", zc.round_robin_gradients);
  z.get("ignore_unused_parameters", zc.ignore_unused_parameters);
  z.get("use_multi_rank_bucket_allreduce", zc.use_multi_rank_bucket_allreduce);
  z.get("mics_shard_size", zc.mics_shard_size);
  z.get("zero_hpz_partition_size", zc.zero_hpz_partition_size, kPositive);
  z.get("zero_quantized_weights", zc.zero_quantized_weights);
  z.get("zero_quantized_gradients", zc.zero_quantized_gradients);
  z.get("zero_quantized_nontrainable_weights", zc.zero_quantized_nontrainable_weights);
  warn_unimplemented_zero(z, zc);

  bool param_given = read_offload_param(z, d, zc.offload_param);
  bool optimizer_given = read_offload_optimizer(z, d, zc.offload_optimizer);
  read_legacy_offload(z, "cpu_offload", optimizer_given, "offload_optimizer",
                      zc.offload_optimizer.device);
  read_legacy_offload(z, "cpu_offload_param", param_given, "offload_param",
                      zc.offload_param.device);
  bool legacy_pin = false;
  if (z.get("cpu_offload_use_pin_memory", legacy_pin)) {
    d.warn(z.key_path("cpu_offload_use_pin_memory"),
           "deprecated and ignored; use offload_param/offload_optimizer.pin_memory");
  }
  bool legacy_stage1 = false;
  if (z.get("legacy_stage1", legacy_stage1) && legacy_stage1) {
    d.error(z.key_path("legacy_stage1"), "got true; allowed: false (removed from DeepSpeed)");
  }
  for (const char* key : {"mics_hierarchical_params_gather", "pipeline_loading_checkpoint",
                          "log_trace_cache_warnings", "enable_sanity_checks",
                          "save_muon_momentum_buffer_in_memory"}) {
    z.ignore(key, false);
  }
  z.ignore("memory_efficient_linear", true);
  z.ignore("override_module_apply", true);
  z.ignore("zeropp_loco_param", nullptr);
  z.ignore("zenflow", nullptr);
  z.ignore("leaf_module", Json::object());
  z.finish();
  if (stage_valid) check_offload_stage(d, zc);  // a bad stage is reported already
}

void read_aio(SectionReader& root, Diagnostics& d, AioConfig& a) {
  SectionReader s(object_at(root, "aio"), "aio", d, /*auto_means_default=*/false);
  if (s.get("block_size", a.block_size, kPositive) && a.block_size % 4096 != 0) {
    d.error("aio.block_size", "got " + std::to_string(a.block_size) +
                                  "; allowed: a positive multiple of 4096 (O_DIRECT alignment)");
  }
  s.get("queue_depth", a.queue_depth, IntRange{1, 65536});
  // Current DeepSpeed reads intra_op_parallelism; older releases thread_count; the tuning
  // tool prints num_threads.
  auto [v, name] = s.take_one_of({"intra_op_parallelism", "thread_count", "num_threads"});
  if (v) s.get(name, a.intra_op_parallelism, IntRange{1, 1024});
  s.get("single_submit", a.single_submit);
  s.get("overlap_events", a.overlap_events);
  if (s.get("use_gds", a.use_gds) && a.use_gds) {
    d.warn("aio.use_gds", "outcore has no GPUDirect Storage path; I/O goes through host memory");
  }
  s.finish();
}

void read_activation_checkpointing(SectionReader& root, Diagnostics& d,
                                   ActivationCheckpointingConfig& a) {
  SectionReader s(object_at(root, "activation_checkpointing"), "activation_checkpointing", d,
                  /*auto_means_default=*/false);
  s.get("partition_activations", a.partition_activations);
  s.get("cpu_checkpointing", a.cpu_checkpointing);
  s.get("contiguous_memory_optimization", a.contiguous_memory_optimization);
  s.get("number_checkpoints", a.number_checkpoints, kPositive);
  s.get("synchronize_checkpoint_boundary", a.synchronize_checkpoint_boundary);
  s.get("profile", a.profile);
  s.finish();
  if (a.contiguous_memory_optimization && (!a.partition_activations || !a.number_checkpoints)) {
    d.error("activation_checkpointing.contiguous_memory_optimization",
            "true requires partition_activations: true and number_checkpoints; allowed: false "
            "otherwise");
  }
}

void read_outcore(SectionReader& root, Diagnostics& d, OutcoreConfig& o) {
  SectionReader s(object_at(root, "outcore"), "outcore", d, /*auto_means_default=*/false);
  s.get("device_memory_mb", o.device_memory_mb);
  s.get("swap_checksum", o.swap_checksum);
  s.get("metrics_file", o.metrics_file, /*null_is_empty=*/true);
  s.get("pinned_memory_mb", o.pinned_memory_mb);
  std::string level = o.log_level;
  if (s.get("log_level", level, /*null_is_empty=*/false)) {
    level = detail::lower(level);
    bool ok = false;
    for (const char* l : {"trace", "debug", "info", "warn", "error", "critical", "off"}) {
      ok = ok || level == l;
    }
    if (ok) {
      o.log_level = level;
    } else {
      d.error("outcore.log_level",
              "got " + show(Json(level)) +
                  "; allowed: \"trace\", \"debug\", \"info\", \"warn\", \"error\", "
                  "\"critical\" or \"off\"");
    }
  }
  s.finish();
}

// DeepSpeed keys and sections outcore accepts but does not act on.
void read_ignored_top_level(SectionReader& root) {
  root.ignore("zero_force_ds_cpu_optimizer", true);
  root.ignore("managed_gradient_accumulation", true);
  root.ignore("gradient_allreduce_op", "mean");
  root.ignore("communication_data_type", nullptr);
  root.ignore("seq_parallel_communication_data_type", "fp32");
  root.ignore("vocabulary_size", nullptr);
  root.ignore("log_level", nullptr);
  for (const char* key :
       {"sparse_gradients", "disable_allgather", "dump_state", "dataloader_drop_last",
        "graph_harvesting", "use_data_before_expert_parallelism"}) {
    root.ignore(key, false);
  }
  for (const char* section : {"tensorboard",
                              "wandb",
                              "csv_monitor",
                              "comet",
                              "flops_profiler",
                              "comms_logger",
                              "checkpoint",
                              "data_types",
                              "amp",
                              "torch_autocast",
                              "compile",
                              "elasticity",
                              "autotuning",
                              "sparse_attention",
                              "data_efficiency",
                              "curriculum_learning",
                              "pipeline",
                              "compression_training",
                              "hybrid_engine",
                              "nebula",
                              "weight_quantization",
                              "quantize_training",
                              "eigenvalue",
                              "progressive_layer_drop"}) {
    const Json* v = root.take(section);
    bool disabled = v && v->is_object() && v->contains("enabled") && (*v)["enabled"] == false;
    if (v && !v->is_null() && !disabled) {
      root.diagnostics().warn(section, "DeepSpeed section not used by outcore; ignored");
    }
  }
}

void read_top_level(SectionReader& root, Diagnostics& d, Config& c) {
  root.get_auto("train_batch_size", c.train_batch_size, kPositive);
  root.get_auto("train_micro_batch_size_per_gpu", c.train_micro_batch_size_per_gpu, kPositive);
  root.get_auto("gradient_accumulation_steps", c.gradient_accumulation_steps, kPositive);
  root.get_auto("gradient_clipping", c.gradient_clipping, kNonNegativeReal);
  root.get("steps_per_print", c.steps_per_print, kPositive);
  root.get("wall_clock_breakdown", c.wall_clock_breakdown);
  root.get("memory_breakdown", c.memory_breakdown);
  root.get("prescale_gradients", c.prescale_gradients);
  root.get("gradient_predivide_factor", c.gradient_predivide_factor, kPositiveReal);
  root.get("zero_allow_untested_optimizer", c.zero_allow_untested_optimizer);
  read_fp16(root, d, c.fp16);
  read_bf16(root, d, c.bf16);
  read_optimizer(root, d, c.optimizer);
  read_scheduler(root, d, c.scheduler);
  read_zero(root, d, c.zero_optimization);
  read_aio(root, d, c.aio);
  read_activation_checkpointing(root, d, c.activation_checkpointing);
  read_outcore(root, d, c.outcore);
  read_ignored_top_level(root);
  root.finish();
  if (c.fp16.enabled.value_or(false) && c.bf16.enabled.value_or(false)) {
    d.error("bf16.enabled",
            "true while fp16.enabled is also true; allowed: at most one of "
            "fp16 and bf16 enabled");
  }
}

void index_paths(const Json& v, const std::string& path,
                 std::unordered_map<std::string, size_t>& index) {
  index.emplace(path, index.size());
  if (!v.is_object()) return;
  for (const auto& [key, child] : v.items())
    index_paths(child, detail::join_path(path, key), index);
}

// Position in the document of `path`, or of its nearest enclosing key that exists (a
// missing key's problem is placed at its section).
size_t file_position(std::string path, const std::unordered_map<std::string, size_t>& index) {
  while (true) {
    auto it = index.find(path);
    if (it != index.end()) return it->second;
    size_t cut = path.find_last_of(".[");
    if (cut == std::string::npos) return 0;
    path.resize(cut);
  }
}

// Orders issues as their keys appear in the file (stable: same-key issues keep their order).
void sort_by_file_order(std::vector<ConfigIssue>& issues, const Json& doc) {
  std::unordered_map<std::string, size_t> index;
  index_paths(doc, "", index);
  std::stable_sort(issues.begin(), issues.end(), [&](const ConfigIssue& a, const ConfigIssue& b) {
    return file_position(a.json_path, index) < file_position(b.json_path, index);
  });
}

}  // namespace

ParsedConfig parse_config(std::string_view text, std::string_view source) {
  std::string src(source);
  detail::LenientParse lp = detail::parse_lenient_json(text);
  Diagnostics d;
  d.errors = std::move(lp.errors);
  ParsedConfig out;
  if (lp.value.is_object()) {
    SectionReader root(&lp.value, "", d, /*auto_means_default=*/false);
    read_top_level(root, d, out.config);
    sort_by_file_order(d.errors, lp.value);
    sort_by_file_order(d.warnings, lp.value);
  } else if (d.errors.empty()) {
    d.error("", "the config must be a JSON object ({...}); got " + show(lp.value));
  }
  for (const ConfigIssue& w : d.warnings) log::warn("{}: {}", src, w.to_string());
  if (!d.errors.empty()) throw ConfigValidationError(src, std::move(d.errors));
  out.warnings = std::move(d.warnings);
  return out;
}

ParsedConfig load_config_file(const std::string& path) {
  struct Closer {
    void operator()(std::FILE* f) const { std::fclose(f); }
  };
  std::unique_ptr<std::FILE, Closer> file(std::fopen(path.c_str(), "rb"));
  if (!file) {
    throw ConfigValidationError(path,
                                {{"", "cannot open the config file: " + errno_string(errno)}});
  }
  std::string text;
  char buf[65536];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, file.get())) > 0) text.append(buf, n);
  if (std::ferror(file.get())) {
    throw ConfigValidationError(path,
                                {{"", "cannot read the config file: " + errno_string(errno)}});
  }
  return parse_config(text, path);
}

}  // namespace outcore::config
