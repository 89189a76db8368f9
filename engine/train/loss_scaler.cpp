#include "engine/train/loss_scaler.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "common/json_dom.hpp"
#include "common/log.hpp"

namespace outcore::train {
namespace {

constexpr double kScaleFactor = 2.0;

void require_fp16(bool ok, const char* key, const std::string& msg) {
  if (!ok) throw ConfigError(std::string("fp16.") + key, msg);
}

}  // namespace

LossScaler::LossScaler() { state_.cur_scale = 1.0; }

LossScaler::LossScaler(const LossScalerOptions& o) : opts_(o) {
  require_fp16(std::isfinite(o.loss_scale) && o.loss_scale >= 0, "loss_scale",
               fmt::format("must be a finite number >= 0, got {}", o.loss_scale));
  dynamic_ = o.loss_scale == 0;
  if (!dynamic_) {
    state_.cur_scale = o.loss_scale;
    return;
  }
  require_fp16(o.initial_scale_power >= 0 && o.initial_scale_power <= 1023, "initial_scale_power",
               fmt::format("must be in 0..1023, got {}", o.initial_scale_power));
  require_fp16(o.loss_scale_window >= 1, "loss_scale_window",
               fmt::format("must be >= 1 with dynamic loss scaling, got {}", o.loss_scale_window));
  require_fp16(o.hysteresis >= 1, "hysteresis",
               fmt::format("must be >= 1 with dynamic loss scaling, got {}", o.hysteresis));
  require_fp16(std::isfinite(o.min_loss_scale) && o.min_loss_scale > 0, "min_loss_scale",
               fmt::format("must be > 0 with dynamic loss scaling, got {}", o.min_loss_scale));
  state_.cur_scale = std::ldexp(1.0, o.initial_scale_power);
  state_.cur_iter = 0;
  state_.last_overflow_iter = -1;
  state_.cur_hysteresis = o.hysteresis;
}

LossScaleUpdate LossScaler::update(bool overflow) {
  LossScaleUpdate u;
  u.overflow = overflow;
  u.scale_before = state_.cur_scale;
  if (!dynamic_) {
    u.scale_after = state_.cur_scale;
    if (overflow) u.message = "OVERFLOW! Skipping step (static loss scale).";
    return u;
  }
  LossScalerState& s = state_;
  if (overflow) {
    if (opts_.hysteresis == 1 || s.cur_hysteresis == 1) {
      if (s.cur_scale == opts_.min_loss_scale && opts_.raise_error_at_min_scale) {
        throw LossScaleAtMinimum(fmt::format(
            "fp16 gradients overflowed at the minimum loss scale {} (fp16.min_loss_scale): "
            "current loss scale already at minimum - cannot decrease scale anymore",
            opts_.min_loss_scale));
      }
      double next = std::max(s.cur_scale / kScaleFactor, opts_.min_loss_scale);
      u.message = fmt::format("OVERFLOW! Skipping step. Attempted loss scale: {}, reducing to {}",
                              s.cur_scale, next);
      s.cur_scale = next;
    } else {
      u.message = fmt::format(
          "OVERFLOW! Skipping step. Attempted loss scale: {}, but hysteresis is {}. Reducing "
          "hysteresis to {}",
          s.cur_scale, s.cur_hysteresis, s.cur_hysteresis - 1);
      s.cur_hysteresis -= 1;
    }
    s.last_overflow_iter = s.cur_iter;
  } else {
    if (opts_.consecutive_hysteresis) s.cur_hysteresis = opts_.hysteresis;
    int64_t stable = s.cur_iter - s.last_overflow_iter - 1;
    if (stable > 0 && stable % opts_.loss_scale_window == 0) {
      if (!opts_.consecutive_hysteresis) s.cur_hysteresis = opts_.hysteresis;
      s.cur_scale *= kScaleFactor;
    }
  }
  s.cur_iter += 1;
  u.scale_after = s.cur_scale;
  u.hysteresis_after = s.cur_hysteresis;
  return u;
}

void LossScaler::load_state(const LossScalerState& s) {
  auto bad = [](const std::string& what) { throw InvalidArgument("loss scaler state: " + what); };
  if (!std::isfinite(s.cur_scale) || s.cur_scale <= 0)
    bad(fmt::format("scale {} is not > 0", s.cur_scale));
  if (!dynamic_) {
    if (s.cur_scale != state_.cur_scale) {
      bad(fmt::format("static scale {} differs from the configured {}", s.cur_scale,
                      state_.cur_scale));
    }
    return;
  }
  if (s.cur_iter < 0) bad(fmt::format("cur_iter {} is negative", s.cur_iter));
  if (s.last_overflow_iter < -1 ||
      (s.last_overflow_iter >= 0 && s.last_overflow_iter >= s.cur_iter)) {
    bad(fmt::format("last_overflow_iter {} is not in [-1, cur_iter {})", s.last_overflow_iter,
                    s.cur_iter));
  }
  if (s.cur_hysteresis < 1) bad(fmt::format("hysteresis {} is below 1", s.cur_hysteresis));
  state_ = s;
  // A run resumed with a lower fp16.hysteresis: the overflows it still tolerates are at most
  // the new value.
  if (s.cur_hysteresis > opts_.hysteresis) {
    log::warn(
        "fp16.hysteresis {} is below the {} overflows the checkpoint's loss scaler had "
        "left before lowering the scale: {} from here",
        opts_.hysteresis, s.cur_hysteresis, opts_.hysteresis);
    state_.cur_hysteresis = opts_.hysteresis;
  }
}

nlohmann::json LossScaler::state_json() const {
  return {{"dynamic", dynamic_},
          {"cur_scale", state_.cur_scale},
          {"cur_iter", state_.cur_iter},
          {"last_overflow_iter", state_.last_overflow_iter},
          {"cur_hysteresis", state_.cur_hysteresis}};
}

void LossScaler::load_state_json(const nlohmann::json& j) {
  auto fail = [&](const char* field) {
    throw InvalidArgument(
        fmt::format("loss scaler state: '{}' is missing or mistyped in {}", field, json_brief(j)));
  };
  if (!j.is_object()) fail("cur_scale");
  if (!j.contains("dynamic") || !j["dynamic"].is_boolean()) fail("dynamic");
  if (j["dynamic"].get<bool>() != dynamic_) {
    // fp32 and bf16 runs save a static scale of 1: name the fp16 keys that decide the kind.
    auto kind = [](bool dynamic) {
      return dynamic ? "dynamic loss scaling (fp16 enabled, fp16.loss_scale 0)"
                     : "a static loss scale (fp16 off, or fp16.loss_scale > 0)";
    };
    throw InvalidArgument(fmt::format(
        "loss scaler state: the checkpoint was saved with {}, this config asks for {}: the "
        "scaler's state carries over only to the same kind (to change it, export the weights "
        "and start a new run with --init-from)",
        kind(j["dynamic"].get<bool>()), kind(dynamic_)));
  }
  LossScalerState s;
  if (!j.contains("cur_scale") || !j["cur_scale"].is_number()) fail("cur_scale");
  s.cur_scale = j["cur_scale"].get<double>();
  for (auto [name, field] :
       {std::pair{"cur_iter", &s.cur_iter}, std::pair{"last_overflow_iter", &s.last_overflow_iter},
        std::pair{"cur_hysteresis", &s.cur_hysteresis}}) {
    if (!j.contains(name) || !j[name].is_number_integer()) fail(name);
    *field = j[name].get<int64_t>();
  }
  load_state(s);
}

}  // namespace outcore::train
