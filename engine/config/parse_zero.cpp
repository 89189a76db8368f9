// The "zero_optimization" section with its offload blocks and legacy forms.
#include <string>
#include <string_view>

#include "engine/config/section_parsers.hpp"

namespace outcore::config::detail {
namespace {

void read_offload_common(SectionReader& s, OffloadDevice& device, std::string& nvme_path,
                         int64_t& buffer_count, bool& pin_memory) {
  s.get_enum("device", device,
             {{"none", OffloadDevice::kNone},
              {"cpu", OffloadDevice::kCpu},
              {"nvme", OffloadDevice::kNvme}});
  s.get("nvme_path", nvme_path, /*null_is_empty=*/true);
  // Each buffer is a pinned allocation of a whole partition (or sub-group): past 4096 a count
  // is a typo, not a tuning choice.
  s.get("buffer_count", buffer_count, IntRange{1, kMaxOffloadBufferCount});
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
  s.get("cpuadam_cores_perc", o.cpuadam_cores_perc,
        RealRange{.min = 0, .max = 1, .min_exclusive = true});
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
  // offload_optimizer.ratio below stage 3: ignored, as DeepSpeed's stages 1 and 2 ignore it
  // (said with the keys without effect).
}

}  // namespace

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

}  // namespace outcore::config::detail
