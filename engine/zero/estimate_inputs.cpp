// The model shape `outcore estimate` and the Python outcore.estimate plan for (see plan.hpp).
#include <fmt/format.h>

#include <algorithm>

#include "common/error.hpp"
#include "common/log.hpp"
#include "engine/zero/plan.hpp"

namespace outcore::zero {

model::ModelOptions estimate_model_options(config::Config& cfg, const model::LlamaConfig& model,
                                           const EstimateInputs& in) {
  config::AutoContext ctx;
  ctx.world_size = in.world_size;
  ctx.hidden_size = model.hidden_size;
  // The micro-batch replaces the config's where the config sets a micro-batch or an
  // accumulation (the accumulation, written or following from them, kept); where it sets
  // neither, or "auto", it fills the micro-batch as train's --micro-batch-size does.
  const bool replaces = in.micro_batch > 0 && !cfg.train_micro_batch_size_per_gpu.is_auto() &&
                        (cfg.train_micro_batch_size_per_gpu.has_value() ||
                         cfg.gradient_accumulation_steps.has_value());
  if (in.micro_batch > 0 && !replaces) ctx.micro_batch_size = in.micro_batch;
  // The config's train_batch_size (0: none written, or "auto").
  const int64_t written_batch =
      cfg.train_batch_size.has_value() ? cfg.train_batch_size.value() : int64_t{0};
  config::resolve_auto(cfg, ctx);
  if (replaces) {  // as if the config said so, with its accumulation
    int64_t batch = 0;
    if (__builtin_mul_overflow(in.micro_batch, cfg.gradient_accumulation_steps.value(), &batch) ||
        __builtin_mul_overflow(batch, in.world_size, &batch))
      throw InvalidArgument(
          fmt::format("micro-batch {} x gradient_accumulation_steps {} x world size {} overflows",
                      in.micro_batch, cfg.gradient_accumulation_steps.value(), in.world_size));
    if (written_batch != 0 && written_batch != batch)
      log::warn(
          "planning train_batch_size {} (micro-batch {} x gradient_accumulation_steps {} x "
          "world size {}) in place of the config's {}: the micro-batch asked for replaces the "
          "config's {} and its accumulation is kept",
          batch, in.micro_batch, cfg.gradient_accumulation_steps.value(), in.world_size,
          written_batch, cfg.train_micro_batch_size_per_gpu.value());
    cfg.train_micro_batch_size_per_gpu.set(in.micro_batch);
    cfg.train_batch_size.set(batch);
  }
  model::ModelOptions mo;
  mo.micro_batch =
      in.micro_batch > 0 ? in.micro_batch : cfg.train_micro_batch_size_per_gpu.value_or(1);
  mo.seq_len = in.seq_len > 0 ? in.seq_len : std::min<int64_t>(model.max_position_embeddings, 1024);
  mo.param_dtype = cfg.fp16.enabled.value_or(false)   ? DType::F16
                   : cfg.bf16.enabled.value_or(false) ? DType::BF16
                                                      : DType::F32;
  mo.compute_dtype = config::compute_dtype(cfg);
  const config::ActivationCheckpointingConfig& ac = cfg.activation_checkpointing;
  mo.activation_checkpointing = in.activation_checkpointing || ac.cpu_checkpointing ||
                                ac.partition_activations || ac.number_checkpoints.has_value();
  mo.world_size = static_cast<int>(in.world_size);
  mo.planning_only = true;
  return mo;
}

}  // namespace outcore::zero
