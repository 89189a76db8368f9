// Loss scaling for fp16 training with DeepSpeed's semantics
// (deepspeed/runtime/fp16/loss_scaler.py, DynamicLossScaler / LossScaler, as ZeRO 1-3 use
// them), and the gradient clipping coefficient of ZeRO's unscale_and_clip_grads.
//
// Use per optimizer step: scale the loss by scale() before backward; after backward look
// for inf/nan in the gradients (an overflow); call update(overflow); when it reports the
// step skipped, apply no optimizer update and do not step the lr schedule.
//
// Threading: one thread at a time.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "common/error.hpp"

namespace outcore::train {

// Dynamic scaling hit its floor: an overflow at min_loss_scale. DeepSpeed stops the run
// here ("Current loss scale already at minimum - cannot decrease scale anymore").
class LossScaleAtMinimum : public Error {
 public:
  using Error::Error;
};

// DeepSpeed's fp16 keys. loss_scale > 0 selects a static scale; 0 selects dynamic scaling
// with the other fields.
struct LossScalerOptions {
  double loss_scale = 0;             // static scale when > 0
  int initial_scale_power = 16;      // dynamic scale starts at 2^power; 0..1023
  int64_t loss_scale_window = 1000;  // clean steps before the scale doubles; >= 1
  int64_t hysteresis = 2;            // overflows tolerated before halving ("delayed_shift"); >= 1
  bool consecutive_hysteresis = false;  // refill hysteresis on every clean step
  double min_loss_scale = 1;            // floor of the dynamic scale; > 0
  // Throw LossScaleAtMinimum on an overflow at min_loss_scale (DeepSpeed's default).
  bool raise_error_at_min_scale = true;
};

// What one update() did, for the trainer's log line.
struct LossScaleUpdate {
  bool overflow = false;    // the step must be skipped (no optimizer step, no lr step)
  double scale_before = 0;  // the scale the step ran with
  double scale_after = 0;   // the scale the next step runs with
  int64_t hysteresis_after = 0;
  // "OVERFLOW! Skipping step. Attempted loss scale: 65536, reducing to 32768" or
  // "... but hysteresis is 2. Reducing hysteresis to 1"; empty when nothing happened.
  std::string message;
};

// The full state of a scaler, for checkpoints.
struct LossScalerState {
  double cur_scale = 1;
  int64_t cur_iter = 0;
  int64_t last_overflow_iter = -1;
  int64_t cur_hysteresis = 0;
  bool operator==(const LossScalerState&) const = default;
};

class LossScaler {
 public:
  // A scaler that never scales (bf16, fp32): scale() is 1 and update() changes nothing.
  LossScaler();
  // fp16. Throws ConfigError naming the fp16.* key for a negative or non-finite loss_scale,
  // or (dynamic) initial_scale_power outside 0..1023, loss_scale_window < 1,
  // hysteresis < 1, min_loss_scale <= 0.
  explicit LossScaler(const LossScalerOptions& options);

  bool dynamic() const { return dynamic_; }
  double scale() const { return state_.cur_scale; }
  int64_t hysteresis() const { return state_.cur_hysteresis; }

  // Records whether this step's gradients overflowed and adjusts the scale (dynamic only):
  // - overflow: if hysteresis is 1 (or configured as 1), halve the scale down to
  //   min_loss_scale, or throw LossScaleAtMinimum when already there; otherwise spend one
  //   unit of hysteresis and keep the scale.
  // - clean: with consecutive_hysteresis, refill hysteresis; after every loss_scale_window
  //   clean steps since the last overflow, double the scale (and, without
  //   consecutive_hysteresis, refill hysteresis).
  // A static scaler only reports `overflow` back.
  LossScaleUpdate update(bool overflow);

  LossScalerState state() const { return state_; }
  // Throws InvalidArgument when the state cannot come from these options (a scale <= 0,
  // hysteresis outside 1..hysteresis, last_overflow_iter >= cur_iter, ...).
  void load_state(const LossScalerState& s);

  // {"dynamic": b, "cur_scale": x, "cur_iter": n, "last_overflow_iter": n, "cur_hysteresis": n}
  nlohmann::json state_json() const;
  // Throws InvalidArgument on a missing or mistyped field, or a state load_state rejects.
  void load_state_json(const nlohmann::json& j);

 private:
  LossScalerOptions opts_;
  bool dynamic_ = false;
  LossScalerState state_;
};

// The unscale-and-clip multiplier is zero::unscale_and_clip_multiplier (engine/zero/zero.hpp),
// applied inside ZeroEngine::step.

}  // namespace outcore::train
