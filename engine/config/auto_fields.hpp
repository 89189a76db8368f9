// Internal: visits every AutoOr field of a Config that is in effect (the scheduler's
// parameters only for its type), in the order to_json prints them.
#pragma once

#include "engine/config/config.hpp"

namespace outcore::config::detail {

// `C` is Config or const Config; `f` is called as f(AutoOr<T>&) for each field.
template <typename C, typename F>
void for_each_auto(C& c, F&& f) {
  f(c.train_batch_size);
  f(c.train_micro_batch_size_per_gpu);
  f(c.gradient_accumulation_steps);
  f(c.gradient_clipping);
  f(c.fp16.enabled);
  f(c.bf16.enabled);
  f(c.optimizer.lr);
  f(c.optimizer.betas);
  f(c.optimizer.eps);
  f(c.optimizer.weight_decay);
  switch (c.scheduler.type) {
    case SchedulerType::kWarmupLR:
    case SchedulerType::kWarmupDecayLR:
      f(c.scheduler.warmup.warmup_min_lr);
      f(c.scheduler.warmup.warmup_max_lr);
      f(c.scheduler.warmup.warmup_num_steps);
      if (c.scheduler.type == SchedulerType::kWarmupDecayLR) f(c.scheduler.warmup.total_num_steps);
      break;
    case SchedulerType::kWarmupCosineLR:
      f(c.scheduler.cosine.total_num_steps);
      f(c.scheduler.cosine.warmup_num_steps);
      break;
    case SchedulerType::kOneCycle:
    case SchedulerType::kNone:
      break;
  }
  f(c.zero_optimization.reduce_bucket_size);
  f(c.zero_optimization.stage3_prefetch_bucket_size);
  f(c.zero_optimization.stage3_param_persistence_threshold);
}

}  // namespace outcore::config::detail
