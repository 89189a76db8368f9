// The "optimizer" and "scheduler" sections.
#include <string>
#include <string_view>

#include "engine/config/section_parsers.hpp"

namespace outcore::config::detail {
namespace {

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

// "log" or "linear", compared exactly as DeepSpeed does: another string warms up with log, as
// there, with a warning naming it ("Linear" included).
void read_warmup_type(SectionReader& p, WarmupType& t) {
  const Json* v = p.take("warmup_type");
  if (v == nullptr || v->is_null() ||
      (v->is_string() && v->get_ref<const std::string&>() == "auto"))
    return;  // the default, log
  if (!v->is_string()) {
    p.diagnostics().error(p.key_path("warmup_type"),
                          "got " + show(*v) + "; allowed: \"log\" or \"linear\"");
    return;
  }
  const std::string& name = v->get_ref<const std::string&>();
  if (name == "linear") {
    t = WarmupType::kLinear;
    return;
  }
  t = WarmupType::kLog;
  if (name != "log")
    p.diagnostics().warn(p.key_path("warmup_type"),
                         "\"" + name +
                             "\" is not \"log\" or \"linear\" (compared exactly, as DeepSpeed "
                             "does): the warmup is log, as in DeepSpeed");
}

// Whether `key` is absent (not merely invalid): "missing" is said only then.
bool absent(SectionReader& p, std::string_view key, size_t errors_before) {
  const Json* v = p.take(key);
  return p.diagnostics().errors.size() == errors_before && (v == nullptr || v->is_null());
}

void require(SectionReader& p, bool missing, std::string_view key, std::string_view type,
             const std::string& allowed) {
  if (!missing) return;
  p.diagnostics().error(p.key_path(key),
                        "missing; required by " + std::string(type) + "; allowed: " + allowed);
}

void read_warmup_lr(SectionReader& p, SchedulerType type, WarmupLRParams& w) {
  p.get_auto("warmup_min_lr", w.warmup_min_lr, kNonNegativeFp32);
  p.get_auto("warmup_max_lr", w.warmup_max_lr, kNonNegativeFp32);
  p.get_auto("warmup_num_steps", w.warmup_num_steps, kPositive);
  read_warmup_type(p, w.warmup_type);
  p.ignore("last_batch_iteration", -1);
  if (type == SchedulerType::kWarmupDecayLR) {
    const size_t errors = p.diagnostics().errors.size();
    p.get_auto("total_num_steps", w.total_num_steps, kPositive);
    require(p, w.total_num_steps.is_unset() && absent(p, "total_num_steps", errors),
            "total_num_steps", "WarmupDecayLR", "an integer >= 1 or \"auto\"");
    // DeepSpeed's WarmupDecayLR signature defaults warmup_max_lr to 0.001, unlike WarmupLR.
    if (w.warmup_max_lr.is_unset()) w.warmup_max_lr.set(0.001);
  }
}

void read_warmup_cosine(SectionReader& p, WarmupCosineLRParams& c) {
  const size_t errors = p.diagnostics().errors.size();
  p.get_auto("total_num_steps", c.total_num_steps, kPositive);
  require(p, c.total_num_steps.is_unset() && absent(p, "total_num_steps", errors),
          "total_num_steps", "WarmupCosineLR", "an integer >= 1 or \"auto\"");
  p.get("warmup_min_ratio", c.warmup_min_ratio, kUnitInterval);
  p.get_auto("warmup_num_steps", c.warmup_num_steps, kPositive);
  p.get("cos_min_ratio", c.cos_min_ratio, kUnitInterval);
  read_warmup_type(p, c.warmup_type);
  p.ignore("last_batch_iteration", -1);
}

void read_one_cycle(SectionReader& p, OneCycleParams& c) {
  size_t errors = p.diagnostics().errors.size();
  p.get("cycle_min_lr", c.cycle_min_lr, kNonNegativeFp32);
  require(p, !c.cycle_min_lr && absent(p, "cycle_min_lr", errors), "cycle_min_lr", "OneCycle",
          "a number >= 0");
  errors = p.diagnostics().errors.size();
  p.get("cycle_max_lr", c.cycle_max_lr, kNonNegativeFp32);
  require(p, !c.cycle_max_lr && absent(p, "cycle_max_lr", errors), "cycle_max_lr", "OneCycle",
          "a number >= 0");
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

}  // namespace

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
  p.get_auto("lr", o.lr, kNonNegativeFp32);
  read_betas(p, o.betas);
  // Adam computes in fp32: an eps that rounds to 0 (or to infinity) there is refused.
  p.get_auto(
      "eps", o.eps,
      RealRange{std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::max()});
  p.get_auto("weight_decay", o.weight_decay, kNonNegativeFp32);
  p.get("bias_correction", o.bias_correction);
  if (p.get("adam_w_mode", o.adam_w_mode) && !o.adam_w_mode && o.type == OptimizerType::kAdamW) {
    d.warn("optimizer.params.adam_w_mode",
           "false has no effect with type AdamW (weight decay stays decoupled)");
  }
  p.ignore("torch_adam", false);
  p.get("fp32_optimizer_states", o.fp32_optimizer_states);
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

}  // namespace outcore::config::detail
