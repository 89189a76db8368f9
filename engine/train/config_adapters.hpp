// Builds the trainer's pieces from the typed DeepSpeed config (engine/config): the lr
// schedule of the "scheduler" section and the loss scaler of the "fp16" section.
// Call after config::resolve_auto(); a value still "auto" or unset throws ConfigError
// naming its JSON path.
#pragma once

#include <memory>

#include "engine/config/config.hpp"
#include "engine/train/loss_scaler.hpp"
#include "engine/train/lr_schedule.hpp"

namespace outcore::train {

// The schedule `cfg.scheduler` asks for; no scheduler section gives a constant lr equal to
// optimizer.params.lr. WarmupLR without warmup_max_lr and WarmupCosineLR take the
// optimizer's lr, as DeepSpeed does. Throws ConfigError (naming the key) for unresolved or
// invalid values, and for OneCycle without cycle_min_lr / cycle_max_lr.
std::unique_ptr<LrSchedule> make_lr_schedule(const config::Config& cfg);

// fp16 enabled: the static or dynamic scaler of the fp16 section; otherwise (bf16, fp32) a
// scaler fixed at 1. Throws ConfigError as LossScaler does.
LossScaler make_loss_scaler(const config::Config& cfg);

// The fp16 section as scaler options.
LossScalerOptions loss_scaler_options(const config::FP16Config& fp16);

}  // namespace outcore::train
