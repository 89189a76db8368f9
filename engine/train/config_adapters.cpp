#include "engine/train/config_adapters.hpp"

namespace outcore::train {
namespace {

WarmupCurve curve(config::WarmupType t) {
  return t == config::WarmupType::kLinear ? WarmupCurve::kLinear : WarmupCurve::kLog;
}

}  // namespace

std::unique_ptr<LrSchedule> make_lr_schedule(const config::Config& cfg) {
  const config::SchedulerConfig& s = cfg.scheduler;
  double lr = cfg.optimizer.lr.value();
  switch (s.type) {
    case config::SchedulerType::kNone:
      return make_constant_lr(lr);
    case config::SchedulerType::kWarmupLR:
    case config::SchedulerType::kWarmupDecayLR: {
      const config::WarmupLRParams& w = s.warmup;
      WarmupLROptions o{.warmup_min_lr = w.warmup_min_lr.value(),
                        .warmup_max_lr = w.warmup_max_lr.is_unset() ? lr : w.warmup_max_lr.value(),
                        .warmup_num_steps = w.warmup_num_steps.value(),
                        .warmup_type = curve(w.warmup_type)};
      if (s.type == config::SchedulerType::kWarmupLR) return make_warmup_lr(o);
      return make_warmup_decay_lr({.warmup = o, .total_num_steps = w.total_num_steps.value()});
    }
    case config::SchedulerType::kWarmupCosineLR: {
      const config::WarmupCosineLRParams& c = s.cosine;
      return make_warmup_cosine_lr({.base_lr = lr,
                                    .total_num_steps = c.total_num_steps.value(),
                                    .warmup_min_ratio = c.warmup_min_ratio,
                                    .warmup_num_steps = c.warmup_num_steps.value(),
                                    .cos_min_ratio = c.cos_min_ratio,
                                    .warmup_type = curve(c.warmup_type)});
    }
    case config::SchedulerType::kOneCycle: {
      const config::OneCycleParams& p = s.one_cycle;
      if (!p.cycle_min_lr)
        throw ConfigError("scheduler.params.cycle_min_lr", "required by OneCycle");
      if (!p.cycle_max_lr)
        throw ConfigError("scheduler.params.cycle_max_lr", "required by OneCycle");
      return make_one_cycle({.cycle_min_lr = *p.cycle_min_lr,
                             .cycle_max_lr = *p.cycle_max_lr,
                             .decay_lr_rate = p.decay_lr_rate,
                             .cycle_first_step_size = p.cycle_first_step_size,
                             .cycle_second_step_size = p.cycle_second_step_size,
                             .cycle_first_stair_count = p.cycle_first_stair_count,
                             .cycle_second_stair_count = p.cycle_second_stair_count,
                             .decay_step_size = p.decay_step_size,
                             .cycle_momentum = p.cycle_momentum,
                             .cycle_min_mom = p.cycle_min_mom,
                             .cycle_max_mom = p.cycle_max_mom,
                             .decay_mom_rate = p.decay_mom_rate});
    }
  }
  throw ConfigError("scheduler.type", "unsupported scheduler");
}

LossScalerOptions loss_scaler_options(const config::FP16Config& f) {
  return {.loss_scale = f.loss_scale,
          .initial_scale_power = f.initial_scale_power,
          .loss_scale_window = f.loss_scale_window,
          .hysteresis = f.hysteresis,
          .consecutive_hysteresis = f.consecutive_hysteresis,
          .min_loss_scale = f.min_loss_scale};
}

LossScaler make_loss_scaler(const config::Config& cfg) {
  if (!cfg.fp16.enabled.value()) return LossScaler();
  return LossScaler(loss_scaler_options(cfg.fp16));
}

}  // namespace outcore::train
