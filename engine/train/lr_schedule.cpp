#include "engine/train/lr_schedule.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numbers>

#include "common/error.hpp"
#include "common/json_dom.hpp"
#include "common/log.hpp"

namespace outcore::train {
namespace {

constexpr const char* kParams = "scheduler.params.";

void require_param(bool ok, const char* key, const std::string& msg) {
  if (!ok) throw ConfigError(std::string(kParams) + key, msg);
}

// The warmup fraction in [0, 1) for i < n (DeepSpeed's _get_gamma warmup branch).
double warmup_gamma(WarmupCurve curve, int64_t i, int64_t n) {
  if (curve == WarmupCurve::kLog)
    return (1.0 / std::log(static_cast<double>(n))) * std::log(static_cast<double>(i + 1));
  return static_cast<double>(i) / static_cast<double>(n);
}

class ConstantLr final : public LrSchedule {
 public:
  explicit ConstantLr(double lr) : lr_(lr) {}
  double lr_at(int64_t) const override { return lr_; }
  std::string_view name() const override { return "constant"; }

 private:
  double lr_;
};

class WarmupLr : public LrSchedule {
 public:
  explicit WarmupLr(const WarmupLROptions& o)
      : o_(o), n_(std::max<int64_t>(2, o.warmup_num_steps)) {}
  double lr_at(int64_t i) const override {
    if (i < 0) return o_.warmup_min_lr;
    return o_.warmup_min_lr + (o_.warmup_max_lr - o_.warmup_min_lr) * gamma(i);
  }
  std::string_view name() const override { return "WarmupLR"; }

 protected:
  virtual double gamma(int64_t i) const {
    return i < n_ ? warmup_gamma(o_.warmup_type, i, n_) : 1.0;
  }
  WarmupLROptions o_;
  int64_t n_;  // max(2, warmup_num_steps)
};

class WarmupDecayLr final : public WarmupLr {
 public:
  explicit WarmupDecayLr(const WarmupDecayLROptions& o)
      : WarmupLr(o.warmup), total_(o.total_num_steps) {}
  std::string_view name() const override { return "WarmupDecayLR"; }

 private:
  double gamma(int64_t i) const override {
    if (i < n_) return warmup_gamma(o_.warmup_type, i, n_);
    return std::max(
        0.0, static_cast<double>(total_ - i) / std::max(1.0, static_cast<double>(total_ - n_)));
  }
  int64_t total_;
};

class WarmupCosineLr final : public LrSchedule {
 public:
  explicit WarmupCosineLr(const WarmupCosineLROptions& o)
      : o_(o), n_(std::max<int64_t>(2, o.warmup_num_steps)) {}
  double lr_at(int64_t i) const override { return i < 0 ? 0.0 : o_.base_lr * ratio(i); }
  std::string_view name() const override { return "WarmupCosineLR"; }

 private:
  double ratio(int64_t i) const {
    if (i < n_) {
      double r = warmup_gamma(o_.warmup_type, i, n_);
      return o_.warmup_min_ratio + r * (1.0 - o_.warmup_min_ratio);
    }
    double real_last = static_cast<double>(i - n_ + 1);
    double real_total = static_cast<double>(std::max<int64_t>(1, o_.total_num_steps - n_));
    double progress = std::min(1.0, real_last / real_total);
    double r = (1 + std::cos(std::numbers::pi * progress)) / 2;
    return std::max(0.0, o_.cos_min_ratio + (1.0 - o_.cos_min_ratio) * r);
  }
  WarmupCosineLROptions o_;
  int64_t n_;
};

class OneCycle final : public LrSchedule {
 public:
  explicit OneCycle(const OneCycleOptions& o) : o_(o) {
    first_ = static_cast<double>(o.cycle_first_step_size);
    second_ = static_cast<double>(o.cycle_second_step_size.value_or(o.cycle_first_step_size));
    total_ = first_ + second_;
    ratio_ = first_ / total_;
    first_stairs_ = o.cycle_first_stair_count;
    second_stairs_ = o.cycle_second_stair_count.value_or(o.cycle_first_stair_count);
    // DeepSpeed skips decay when the step size or the rate is zero (math.isclose(x, 0)
    // with its default tolerances holds only for x == 0).
    skip_lr_decay_ = o.decay_step_size == 0 || o.decay_lr_rate == 0.0;
    skip_mom_decay_ = o.decay_step_size == 0 || o.decay_mom_rate == 0.0;
  }

  double lr_at(int64_t i) const override {
    if (i < 0) return o_.cycle_min_lr;  // the constructor's write
    if (static_cast<double>(i) < total_) {
      return o_.cycle_min_lr + (o_.cycle_max_lr - o_.cycle_min_lr) * scale(i);
    }
    if (skip_lr_decay_) return o_.cycle_min_lr;
    double interval = static_cast<double>(i - static_cast<int64_t>(total_) + 1) /
                      static_cast<double>(o_.decay_step_size);
    return o_.cycle_min_lr / (1 + o_.decay_lr_rate * interval);
  }

  std::optional<Betas> betas_at(int64_t i) const override {
    if (!o_.cycle_momentum) return std::nullopt;
    // DeepSpeed's constructor writes (cycle_min_mom, 0.99) before the first step, although
    // the cycle itself starts at cycle_max_mom.
    if (i < 0) return Betas{o_.cycle_min_mom, kBeta2};
    if (static_cast<double>(i) < total_) {
      return Betas{o_.cycle_max_mom - (o_.cycle_max_mom - o_.cycle_min_mom) * scale(i), kBeta2};
    }
    if (skip_mom_decay_) return Betas{o_.cycle_max_mom, kBeta2};
    double interval = static_cast<double>(i - static_cast<int64_t>(total_) + 1) /
                      static_cast<double>(o_.decay_step_size);
    return Betas{o_.cycle_max_mom * (1 + o_.decay_mom_rate * interval), kBeta2};
  }

  std::string_view name() const override { return "OneCycle"; }

 private:
  static constexpr double kBeta2 = 0.99;  // DeepSpeed sets betas to (mom, 0.99)

  double scale(int64_t i) const {
    double b = static_cast<double>(i + 1);
    double cycle = std::floor(1 + b / total_);
    double x = 1.0 + b / total_ - cycle;
    double s;
    int64_t stairs;
    if (x <= ratio_) {
      s = x / ratio_;
      stairs = first_stairs_;
    } else {
      s = (x - 1) / (ratio_ - 1);
      stairs = second_stairs_;
    }
    if (stairs > 0) {
      double it = std::fmod(b, total_);
      double pos = it <= first_ ? it * static_cast<double>(stairs) / first_
                                : (total_ - it) * static_cast<double>(stairs) / second_;
      s = std::floor(pos) / static_cast<double>(stairs);
    }
    return s;
  }

  OneCycleOptions o_;
  double first_, second_, total_, ratio_;
  int64_t first_stairs_, second_stairs_;
  bool skip_lr_decay_, skip_mom_decay_;
};

}  // namespace

WarmupCurve parse_warmup_curve(std::string_view name) {
  if (name == "linear") return WarmupCurve::kLinear;
  if (name != "log") {
    log::warn("scheduler.params.warmup_type: unknown warmup type '{}', using log", name);
  }
  return WarmupCurve::kLog;
}

void LrSchedule::set_last_batch_iteration(int64_t i) {
  if (i < -1) throw InvalidArgument(fmt::format("last_batch_iteration {} is below -1", i));
  last_batch_iteration_ = i;
}

nlohmann::json LrSchedule::state_json() const {
  return {{"last_batch_iteration", last_batch_iteration_}};
}

void LrSchedule::load_state_json(const nlohmann::json& j) {
  if (!j.is_object() || !j.contains("last_batch_iteration") ||
      !j["last_batch_iteration"].is_number_integer()) {
    throw InvalidArgument(
        fmt::format("lr scheduler state: 'last_batch_iteration' is missing or not an integer in {}",
                    json_brief(j)));
  }
  set_last_batch_iteration(j["last_batch_iteration"].get<int64_t>());
}

std::unique_ptr<LrSchedule> make_constant_lr(double lr) { return std::make_unique<ConstantLr>(lr); }

namespace {
void check_warmup(int64_t warmup_num_steps) {
  require_param(warmup_num_steps >= 1, "warmup_num_steps",
                fmt::format("must be a positive integer, got {}", warmup_num_steps));
}
void check_total(int64_t total) {
  require_param(total >= 1, "total_num_steps", fmt::format("must be >= 1, got {}", total));
}
}  // namespace

std::unique_ptr<LrSchedule> make_warmup_lr(const WarmupLROptions& o) {
  check_warmup(o.warmup_num_steps);
  return std::make_unique<WarmupLr>(o);
}

std::unique_ptr<LrSchedule> make_warmup_decay_lr(const WarmupDecayLROptions& o) {
  check_warmup(o.warmup.warmup_num_steps);
  check_total(o.total_num_steps);
  if (o.total_num_steps < o.warmup.warmup_num_steps) {
    log::warn("scheduler.params.total_num_steps {} is less than warmup_num_steps {}",
              o.total_num_steps, o.warmup.warmup_num_steps);
  }
  return std::make_unique<WarmupDecayLr>(o);
}

std::unique_ptr<LrSchedule> make_warmup_cosine_lr(const WarmupCosineLROptions& o) {
  check_warmup(o.warmup_num_steps);
  check_total(o.total_num_steps);
  if (o.total_num_steps < o.warmup_num_steps) {
    log::warn("scheduler.params.total_num_steps {} is less than warmup_num_steps {}",
              o.total_num_steps, o.warmup_num_steps);
  }
  return std::make_unique<WarmupCosineLr>(o);
}

std::unique_ptr<LrSchedule> make_one_cycle(const OneCycleOptions& o) {
  require_param(o.cycle_first_step_size >= 1, "cycle_first_step_size",
                fmt::format("must be >= 1, got {}", o.cycle_first_step_size));
  int64_t second = o.cycle_second_step_size.value_or(o.cycle_first_step_size);
  require_param(second >= 1, "cycle_second_step_size", fmt::format("must be >= 1, got {}", second));
  require_param(o.cycle_first_stair_count >= 0, "cycle_first_stair_count",
                fmt::format("must be >= 0, got {}", o.cycle_first_stair_count));
  require_param(o.cycle_second_stair_count.value_or(0) >= 0, "cycle_second_stair_count",
                fmt::format("must be >= 0, got {}", o.cycle_second_stair_count.value_or(0)));
  require_param(o.decay_step_size >= 0, "decay_step_size",
                fmt::format("must be >= 0, got {}", o.decay_step_size));
  return std::make_unique<OneCycle>(o);
}

}  // namespace outcore::train
