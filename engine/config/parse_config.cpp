// DeepSpeed JSON text -> Config: one reader per section, every problem collected.
#include <limits>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/log.hpp"
#include "engine/config/config.hpp"
#include "engine/config/file_order.hpp"
#include "engine/config/key_effects.hpp"
#include "engine/config/lenient_json.hpp"
#include "engine/config/section_parsers.hpp"

namespace outcore::config {
namespace {

using detail::Diagnostics;
using detail::IntRange;
using detail::Json;
using detail::kNonNegativeReal;
using detail::kPositive;
using detail::kPositiveReal;
using detail::object_at;
using detail::SectionReader;
using detail::show;

void read_fp16(SectionReader& root, Diagnostics& d, FP16Config& f) {
  SectionReader s(object_at(root, "fp16"), "fp16", d, /*auto_means_default=*/true);
  s.get_auto("enabled", f.enabled);
  s.get("auto_cast", f.auto_cast);
  // A static scale multiplies the fp32 loss: beyond fp32's range every step would overflow.
  s.get("loss_scale", f.loss_scale,
        detail::RealRange{.min = 0, .max = std::numeric_limits<float>::max()});
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

void read_aio(SectionReader& root, Diagnostics& d, AioConfig& a) {
  SectionReader s(object_at(root, "aio"), "aio", d, /*auto_means_default=*/false);
  // The ranges aio::Engine accepts (aio::validate), so that a config it would refuse at start
  // is refused here, naming the key.
  if (s.get("block_size", a.block_size, IntRange{1, kMaxAioBlockSize}) &&
      a.block_size % 4096 != 0) {
    d.error("aio.block_size",
            "got " + std::to_string(a.block_size) +
                "; allowed: a positive multiple of 4096 (O_DIRECT alignment) up to 1 GiB");
  }
  s.get("queue_depth", a.queue_depth, IntRange{1, kMaxAioQueueDepth});
  // Current DeepSpeed reads intra_op_parallelism; older releases thread_count; the tuning
  // tool prints num_threads.
  auto [v, name] = s.take_one_of({"intra_op_parallelism", "thread_count", "num_threads"});
  if (v) s.get(name, a.intra_op_parallelism, IntRange{1, kMaxAioThreads});
  s.get("single_submit", a.single_submit);
  s.get("overlap_events", a.overlap_events);
  s.get("use_gds", a.use_gds);  // no effect: key_effects warns when it is set
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

// A size in MiB, at most kMaxMemoryMb (the engine shifts it into bytes).
void get_mb(SectionReader& s, std::string_view key, uint64_t& out) {
  int64_t mb = 0;
  if (s.get(key, mb, IntRange{0, static_cast<int64_t>(kMaxMemoryMb)}))
    out = static_cast<uint64_t>(mb);
}

void read_outcore(SectionReader& root, Diagnostics& d, OutcoreConfig& o) {
  SectionReader s(object_at(root, "outcore"), "outcore", d, /*auto_means_default=*/false);
  get_mb(s, "device_memory_mb", o.device_memory_mb);
  s.get("swap_checksum", o.swap_checksum);
  s.get("metrics_file", o.metrics_file, /*null_is_empty=*/true);
  get_mb(s, "pinned_memory_mb", o.pinned_memory_mb);
  s.get("step_in_backward", o.step_in_backward);
  std::string compute = o.compute_dtype;
  if (s.get("compute_dtype", compute, /*null_is_empty=*/false)) {
    compute = detail::lower(compute);
    if (compute == "auto" || compute == "fp32" || compute == "bf16") {
      o.compute_dtype = compute;
    } else {
      d.error("outcore.compute_dtype",
              "got " + show(Json(compute)) + "; allowed: \"auto\", \"fp32\" or \"bf16\"");
    }
  }
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

// `file`: the parsed text, for the warnings about keys a user wrote (null for a saved config,
// which writes every key).
void read_top_level(SectionReader& root, Diagnostics& d, Config& c, const Json* file) {
  root.get_auto("train_batch_size", c.train_batch_size, kPositive);
  root.get_auto("train_micro_batch_size_per_gpu", c.train_micro_batch_size_per_gpu,
                IntRange{1, kMaxMicroBatch});
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
  for (ConfigIssue& w : detail::keys_without_effect(c, file)) d.warn(w.json_path, w.message);
  if (c.fp16.enabled.value_or(false) && c.bf16.enabled.value_or(false)) {
    d.error("bf16.enabled",
            "true while fp16.enabled is also true; allowed: at most one of "
            "fp16 and bf16 enabled");
  }
  if (c.outcore.compute_dtype == "bf16" && !c.bf16.enabled.value_or(false)) {
    d.error("outcore.compute_dtype",
            "\"bf16\" needs bf16.enabled true (the bf16 GEMM operands are the bf16 parameters)");
  }
}

std::string more_not_listed(size_t n, std::string_view what) {
  return "and " + std::to_string(n) + " more " + std::string(what) + " (only the first " +
         std::to_string(kMaxListedPerKind) + " are listed)";
}

// Keeps the first kMaxListedPerKind unknown-key warnings (in the current order) and
// counts the rest, with the `unlisted` that sections did not record, in one warning at the
// end.
void cap_unknown_keys(std::vector<ConfigIssue>& warnings, size_t unlisted) {
  size_t unknown = 0;
  size_t kept = 0;
  for (size_t i = 0; i < warnings.size(); ++i) {
    if (detail::is_unknown_key(warnings[i]) && ++unknown > kMaxListedPerKind) continue;
    if (kept != i) warnings[kept] = std::move(warnings[i]);
    ++kept;
  }
  warnings.resize(kept);
  if (unknown > kMaxListedPerKind) unlisted += unknown - kMaxListedPerKind;
  if (unlisted > 0)
    warnings.push_back({"", more_not_listed(unlisted, "unknown keys, also ignored")});
}

}  // namespace

namespace {

ParsedConfig parse(std::string_view text, std::string_view source, bool log_warnings, bool saved) {
  std::string src(source);
  if (text.size() > kMaxConfigBytes) {
    throw ConfigValidationError(
        src, {{"", "the config is " + std::to_string(text.size()) + " bytes; allowed: at most " +
                       std::to_string(kMaxConfigBytes >> 20) + " MiB"}});
  }
  detail::LenientParse lp = detail::parse_lenient_json(text);
  Diagnostics d;
  d.errors = std::move(lp.errors);
  ParsedConfig out;
  if (lp.value.is_object()) {
    SectionReader root(&lp.value, "", d, /*auto_means_default=*/false);
    read_top_level(root, d, out.config, saved ? nullptr : &lp.value);
    detail::sort_by_file_order(lp.value, d.errors, d.warnings);
    cap_unknown_keys(d.warnings, d.unlisted_unknown_keys);
  } else if (d.errors.empty()) {
    d.error("", "the config must be a JSON object ({...}); got " + show(lp.value));
  }
  if (lp.unlisted_duplicates > 0)
    d.error("", more_not_listed(lp.unlisted_duplicates, "duplicate keys"));
  if (log_warnings)
    for (const ConfigIssue& w : d.warnings) log::warn("{}: {}", src, w.to_string());
  if (!d.errors.empty()) throw ConfigValidationError(src, std::move(d.errors));
  out.warnings = std::move(d.warnings);
  return out;
}

}  // namespace

ParsedConfig parse_config(std::string_view text, std::string_view source, bool log_warnings) {
  return parse(text, source, log_warnings, /*saved=*/false);
}

ParsedConfig parse_saved_config(std::string_view text, std::string_view source, bool log_warnings) {
  return parse(text, source, log_warnings, /*saved=*/true);
}

}  // namespace outcore::config
