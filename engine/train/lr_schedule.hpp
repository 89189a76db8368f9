// Learning-rate schedules with DeepSpeed's formulas and stepping
// (deepspeed/runtime/lr_schedules.py): WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle
// (lr and beta1), and a constant lr when no scheduler is configured.
//
// Stepping, as DeepSpeed's engine does it: the state is `last_batch_iteration`, -1 at the
// start. lr() is the value the NEXT optimizer step uses: lr_at(last_batch_iteration). After
// an optimizer step that was applied, the trainer calls step() (last_batch_iteration += 1);
// after a step skipped for overflow it does not. So the first optimizer step uses lr(-1),
// the second lr(0), the k-th lr(k-2), and a skipped step leaves the lr unchanged.
//
// State: last_batch_iteration alone; save it with state_json() and restore it with
// load_state_json() (DeepSpeed's state_dict {"last_batch_iteration": n}).
// Threading: a schedule is used by one thread at a time; const members are pure.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string_view>

namespace outcore::train {

enum class WarmupCurve { kLog, kLinear };

// "log" or "linear". An unknown name logs a warning and gives kLog, as DeepSpeed does.
WarmupCurve parse_warmup_curve(std::string_view name);

struct WarmupLROptions {
  double warmup_min_lr = 0.0;
  double warmup_max_lr = 0.001;     // DeepSpeed: WarmupLR defaults this to the optimizer's lr
  int64_t warmup_num_steps = 1000;  // >= 1; used as max(2, warmup_num_steps)
  WarmupCurve warmup_type = WarmupCurve::kLog;
};

struct WarmupDecayLROptions {
  WarmupLROptions warmup = {};  // DeepSpeed's WarmupDecayLR default warmup_max_lr is 0.001
  int64_t total_num_steps = 0;  // required; lr reaches 0 at this index
};

struct WarmupCosineLROptions {
  double base_lr = 0.001;       // the optimizer's lr; the schedule multiplies it by a ratio
  int64_t total_num_steps = 0;  // required
  double warmup_min_ratio = 0.0;
  int64_t warmup_num_steps = 1000;  // >= 1; used as max(2, warmup_num_steps)
  double cos_min_ratio = 0.0001;
  WarmupCurve warmup_type = WarmupCurve::kLog;
};

struct OneCycleOptions {
  double cycle_min_lr = 0.0;  // required in DeepSpeed
  double cycle_max_lr = 0.0;  // required in DeepSpeed
  double decay_lr_rate = 0.0;
  int64_t cycle_first_step_size = 2000;                            // >= 1
  std::optional<int64_t> cycle_second_step_size = std::nullopt;    // unset: cycle_first_step_size
  int64_t cycle_first_stair_count = 0;                             // 0: continuous
  std::optional<int64_t> cycle_second_stair_count = std::nullopt;  // unset: cycle_first_stair_count
  int64_t decay_step_size = 0;                                     // 0: no decay after the cycle
  bool cycle_momentum = true;
  double cycle_min_mom = 0.8;
  double cycle_max_mom = 0.9;
  double decay_mom_rate = 0.0;
};

// Adam betas set by a schedule (OneCycle with cycle_momentum).
struct Betas {
  double beta1;
  double beta2;
  bool operator==(const Betas&) const = default;
};

class LrSchedule {
 public:
  virtual ~LrSchedule() = default;

  // The lr at batch index i (i >= -1); what DeepSpeed writes into the param groups when
  // last_batch_iteration == i.
  virtual double lr_at(int64_t i) const = 0;
  // The Adam betas at index i when the schedule sets them (OneCycle with cycle_momentum),
  // else nullopt: the optimizer's own betas stay.
  virtual std::optional<Betas> betas_at(int64_t i) const { return std::nullopt; }
  // DeepSpeed's class name ("WarmupLR", ...), "constant" for no scheduler.
  virtual std::string_view name() const = 0;

  // For the next optimizer step.
  double lr() const { return lr_at(last_batch_iteration_); }
  std::optional<Betas> betas() const { return betas_at(last_batch_iteration_); }

  // Call after each optimizer step that was applied (not after a skipped one).
  void step() { ++last_batch_iteration_; }

  int64_t last_batch_iteration() const { return last_batch_iteration_; }
  // REQUIRES i >= -1 (else InvalidArgument).
  void set_last_batch_iteration(int64_t i);

  // {"last_batch_iteration": n}
  nlohmann::json state_json() const;
  // Throws InvalidArgument naming the problem when the field is missing or not an
  // integer >= -1.
  void load_state_json(const nlohmann::json& j);

 private:
  int64_t last_batch_iteration_ = -1;
};

// Each factory validates its options and throws ConfigError naming the scheduler.params
// key that is wrong (warmup_num_steps < 1, total_num_steps < 1, step sizes < 1, ...).
std::unique_ptr<LrSchedule> make_constant_lr(double lr);
std::unique_ptr<LrSchedule> make_warmup_lr(const WarmupLROptions& o);
std::unique_ptr<LrSchedule> make_warmup_decay_lr(const WarmupDecayLROptions& o);
std::unique_ptr<LrSchedule> make_warmup_cosine_lr(const WarmupCosineLROptions& o);
std::unique_ptr<LrSchedule> make_one_cycle(const OneCycleOptions& o);

}  // namespace outcore::train
