// Every config key's effect in outcore, and the warnings for the keys that have none.
#include "engine/config/key_effects.hpp"

#include <fmt/format.h>

#include <string>

namespace outcore::config::detail {
namespace {

constexpr bool H = true;   // honoured
constexpr bool N = false;  // no effect

// Sorted by section as to_json prints them. Scheduler parameters (under "scheduler") are all
// honoured by the lr schedules (tests/train/lr_schedule_test.cpp) and not listed one by one.
constexpr KeyEffect kEffects[] = {
    {"train_batch_size", H, "tests/config/batch_test.cpp: BatchInference.InfersTheMissingKeys"},
    {"train_micro_batch_size_per_gpu", H,
     "tests/trainer/trainer_test.cpp: TrainerTest.GradientAccumulationEqualsOneLargerBatch"},
    {"gradient_accumulation_steps", H,
     "tests/trainer/trainer_test.cpp: TrainerTest.GradientAccumulationEqualsOneLargerBatch"},
    {"gradient_clipping", H,
     "tests/zero/step_test.cpp: ZeroStep.UnscaleAndClipIsDeepSpeedsCombinedMultiplier"},
    {"steps_per_print", H, "tests/train/metrics_test.cpp: Metrics.RefreshModeKeepsEveryNthLine"},
    {"wall_clock_breakdown", N,
     "outcore's progress line and metrics file always report step time, tokens/s and I/O rates"},
    {"memory_breakdown", N, "outcore's progress line always reports the device memory peak"},
    {"prescale_gradients", N,
     "outcore reduces gradients in fp32 and applies 1/world once, in the optimizer step's "
     "multiplier"},
    {"gradient_predivide_factor", N,
     "outcore reduces gradients in fp32 and applies 1/world once, in the optimizer step's "
     "multiplier"},
    {"zero_allow_untested_optimizer", N, "outcore implements only Adam and AdamW"},
    {"fp16.enabled", H,
     "tests/trainer/trainer_test.cpp: TrainerTest.Fp16OverflowSkipsTheStepAndHalvesTheScale"},
    {"fp16.auto_cast", N,
     "outcore's model computes in fp32 from fp16-stored parameters; there is no autocast"},
    {"fp16.loss_scale", H, "tests/train/loss_scaler_test.cpp: LossScaler.StaticScaleNeverChanges"},
    {"fp16.initial_scale_power", H,
     "tests/train/loss_scaler_test.cpp: LossScaler.StartsAtTwoToTheInitialPower"},
    {"fp16.loss_scale_window", H,
     "tests/train/loss_scaler_test.cpp: LossScaler.GrowsAfterEachWindowOfCleanSteps"},
    {"fp16.hysteresis", H,
     "tests/trainer/trainer_test.cpp: TrainerTest.Fp16HysteresisDelaysTheHalving"},
    {"fp16.consecutive_hysteresis", H,
     "tests/train/loss_scaler_test.cpp: LossScaler.ConsecutiveHysteresisRefillsOnEveryCleanStep"},
    {"fp16.min_loss_scale", H,
     "tests/train/loss_scaler_test.cpp: LossScaler.ScaleStopsAtTheMinimumThenOverflowThere"},
    {"fp16.fp16_master_weights_and_grads", N,
     "outcore always keeps fp32 master weights and reduces gradients in fp32"},
    {"bf16.enabled", H,
     "tests/zero/equivalence_test.cpp: Equivalence.EveryPlacementMatchesStage0InMemory"},
    {"bf16.immediate_grad_update", N,
     "outcore accumulates gradients in fp32 per unit as backward goes"},
    {"bf16.check_grad_overflow", H,
     "tests/trainer/trainer_test.cpp: TrainerTest.NonFiniteLossWithoutAnOverflowCheckEndsTheRun"},
    {"bf16.bf16_master_weights_and_grads", N,
     "outcore always keeps fp32 master weights and reduces gradients in fp32"},
    {"bf16.bf16_optimizer_states", H,
     "tests/zero/equivalence_test.cpp: "
     "Bf16Moments.EveryTierMatchesBitwiseAndMovesTwoThirdsOfTheBytes"},
    {"optimizer.type", H,
     "tests/cpu_adam/torch_oracle_test.cpp: TorchOracle.MatchesTorchAdamAndAdamWWithinOnePpm"},
    {"optimizer.params.lr", H,
     "tests/cpu_adam/torch_oracle_test.cpp: TorchOracle.MatchesTorchAdamAndAdamWWithinOnePpm"},
    {"optimizer.params.betas", H,
     "tests/cpu_adam/torch_oracle_test.cpp: TorchOracle.MatchesTorchAdamAndAdamWWithinOnePpm"},
    {"optimizer.params.eps", H,
     "tests/cpu_adam/torch_oracle_test.cpp: TorchOracle.MatchesTorchAdamAndAdamWWithinOnePpm"},
    {"optimizer.params.weight_decay", H,
     "tests/cpu_adam/torch_oracle_test.cpp: TorchOracle.MatchesTorchAdamAndAdamWWithinOnePpm"},
    {"optimizer.params.bias_correction", H,
     "tests/cpu_adam/adam_step_test.cpp: AdamStep.FirstBiasCorrectedStepMovesEveryParamByLr"},
    {"optimizer.params.fp32_optimizer_states", H,
     "tests/zero/equivalence_test.cpp: "
     "Bf16Moments.EveryTierMatchesBitwiseAndMovesTwoThirdsOfTheBytes"},
    {"optimizer.params.adam_w_mode", H,
     "tests/cpu_adam/torch_oracle_test.cpp: TorchOracle.MatchesTorchAdamAndAdamWWithinOnePpm"},
    {"scheduler", H,
     "tests/train/lr_schedule_test.cpp: LrScheduleOracle.MatchesTheReferenceImplementation"},
    {"zero_optimization.stage", H,
     "tests/zero/equivalence_test.cpp: Equivalence.EveryPlacementMatchesStage0InMemory"},
    {"zero_optimization.contiguous_gradients", N,
     "outcore's gradients are always one contiguous fp32 slab per unit"},
    {"zero_optimization.reduce_scatter", N,
     "outcore always reduce-scatters gradients per unit from stage 2 (same sums as all-reduce)"},
    {"zero_optimization.reduce_bucket_size", N,
     "outcore reduces each unit's gradient slab as one collective as its backward ends"},
    {"zero_optimization.allgather_partitions", N, "outcore always all-gathers updated partitions"},
    {"zero_optimization.allgather_bucket_size", N,
     "outcore gathers each unit's slab as one collective"},
    {"zero_optimization.overlap_comm", N,
     "outcore always overlaps gradient reduction and parameter gathers with compute on their "
     "own streams"},
    {"zero_optimization.load_from_fp32_weights", N,
     "outcore checkpoints always restore the fp32 master weights"},
    {"zero_optimization.elastic_checkpoint", N,
     "outcore checkpoints are flat slabs that load at any world size"},
    {"zero_optimization.sub_group_size", H,
     "tests/trainer/resume_test.cpp: ResumeTest.SubGroupsAndPiecesThatDoNotAlignAreBitIdentical"},
    {"zero_optimization.stage3_prefetch_bucket_size", H,
     "tests/zero/plan_test.cpp: Plan.SmallLiveAndReuseLimitsTrafficMatchesThePlan"},
    {"zero_optimization.stage3_param_persistence_threshold", H,
     "tests/zero/plan_test.cpp: Plan.SmallLiveAndReuseLimitsTrafficMatchesThePlan"},
    {"zero_optimization.stage3_model_persistence_threshold", H,
     "tests/zero/plan_test.cpp: Plan.SmallLiveAndReuseLimitsTrafficMatchesThePlan"},
    {"zero_optimization.stage3_max_live_parameters", H,
     "tests/zero/plan_test.cpp: Plan.SmallLiveAndReuseLimitsTrafficMatchesThePlan"},
    {"zero_optimization.stage3_max_reuse_distance", H,
     "tests/zero/plan_test.cpp: Plan.SmallLiveAndReuseLimitsTrafficMatchesThePlan"},
    {"zero_optimization.stage3_gather_16bit_weights_on_model_save", N,
     "outcore exports consolidated weights with `outcore export`"},
    {"zero_optimization.stage3_module_granularity_threshold", N,
     "outcore's unit of gathering is always one decoder layer"},
    {"zero_optimization.stage3_use_all_reduce_for_fetch_params", N,
     "outcore gathers parameters with all-gather"},
    {"zero_optimization.stage3_allgather_sequential", N,
     "outcore gathers each unit's slab as one collective"},
    {"zero_optimization.round_robin_gradients", N,
     "outcore's gradient partitions are fixed per rank"},
    {"zero_optimization.ignore_unused_parameters", N, "every Llama parameter is used"},
    {"zero_optimization.use_multi_rank_bucket_allreduce", N,
     "outcore reduces each unit's slab as one collective"},
    {"zero_optimization.mics_shard_size", N, "outcore does not implement MiCS"},
    {"zero_optimization.zero_hpz_partition_size", N, "outcore does not implement ZeRO++ hpZ"},
    {"zero_optimization.zero_quantized_weights", N, "outcore does not implement ZeRO++ qwZ"},
    {"zero_optimization.zero_quantized_gradients", N, "outcore does not implement ZeRO++ qgZ"},
    {"zero_optimization.zero_quantized_nontrainable_weights", N,
     "outcore does not implement ZeRO++"},
    {"zero_optimization.offload_param.device", H,
     "tests/zero/equivalence_test.cpp: Equivalence.EveryPlacementMatchesStage0InMemory"},
    {"zero_optimization.offload_param.nvme_path", H,
     "tests/zero/plan_test.cpp: Plan.SwapPathWithoutRoomFailsAtStartWithTheBytesNeeded"},
    {"zero_optimization.offload_param.buffer_count", H,
     "tests/zero/plan_test.cpp: PlanVsActual.PeaksAndTrafficMatchThePlan"},
    {"zero_optimization.offload_param.buffer_size", H,
     "tests/zero/max_in_cpu_test.cpp: "
     "BufferSize.SmallerThanTheLargestPartitionInASwapFileIsRefused"},
    {"zero_optimization.offload_param.max_in_cpu", H,
     "tests/zero/max_in_cpu_test.cpp: MaxInCpu.MixedPlacementTrainsBitIdenticallyToStage0"},
    {"zero_optimization.offload_param.pin_memory", H,
     "tests/zero/plan_test.cpp: PlanVsActual.PeaksAndTrafficMatchThePlan"},
    {"zero_optimization.offload_optimizer.device", H,
     "tests/zero/equivalence_test.cpp: Equivalence.EveryPlacementMatchesStage0InMemory"},
    {"zero_optimization.offload_optimizer.nvme_path", H,
     "tests/zero/plan_test.cpp: Plan.SwapPathWithoutRoomFailsAtStartWithTheBytesNeeded"},
    {"zero_optimization.offload_optimizer.buffer_count", H,
     "tests/swap/optimizer_swapper_test.cpp: OptimizerSwapper.StepIsBitIdenticalToInMemoryAdam"},
    {"zero_optimization.offload_optimizer.pin_memory", H,
     "tests/zero/plan_test.cpp: PlanVsActual.PeaksAndTrafficMatchThePlan"},
    {"zero_optimization.offload_optimizer.pipeline_read", H,
     "tests/swap/optimizer_swapper_test.cpp: OptimizerSwapper.StepIsBitIdenticalToInMemoryAdam"},
    {"zero_optimization.offload_optimizer.pipeline_write", H,
     "tests/swap/optimizer_swapper_test.cpp: OptimizerSwapper.StepIsBitIdenticalToInMemoryAdam"},
    {"zero_optimization.offload_optimizer.fast_init", N,
     "outcore initialises optimizer swap files with one streamed write per sub-group"},
    {"zero_optimization.offload_optimizer.ratio", H,
     "tests/zero/partial_offload_test.cpp: PartialOffload.TrainsBitIdenticallyToFullOffload"},
    {"zero_optimization.offload_optimizer.cpuadam_cores_perc", H,
     "tests/zero/step_test.cpp: CpuThreads.TheConfigsShareOfTheHardwareThreads"},
    {"aio.block_size", H,
     "tests/aio/engine_test.cpp: AioRoundTrip.RandomSizesAndOffsetsSurviveWriteThenRead"},
    {"aio.queue_depth", H,
     "tests/aio/engine_test.cpp: AioRoundTrip.RandomSizesAndOffsetsSurviveWriteThenRead"},
    {"aio.intra_op_parallelism", H,
     "tests/aio/engine_test.cpp: AioRoundTrip.RandomSizesAndOffsetsSurviveWriteThenRead"},
    {"aio.single_submit", H,
     "tests/aio/engine_test.cpp: AioRoundTrip.RandomSizesAndOffsetsSurviveWriteThenRead"},
    {"aio.overlap_events", H,
     "tests/aio/engine_test.cpp: AioRoundTrip.RandomSizesAndOffsetsSurviveWriteThenRead"},
    {"aio.use_gds", N, "outcore does not use GPUDirect Storage"},
    {"activation_checkpointing.partition_activations", H,
     "tests/trainer/trainer_test.cpp: TrainerTest.ActivationCheckpointingGivesBitIdenticalLosses"},
    {"activation_checkpointing.cpu_checkpointing", H,
     "tests/model/model_test.cpp: Model.CpuCheckpointingGivesTheSameResultsOffTheDeviceBudget"},
    {"activation_checkpointing.contiguous_memory_optimization", N,
     "outcore's checkpoints are one preallocated buffer per unit already"},
    {"activation_checkpointing.number_checkpoints", H,
     "tests/zero/plan_test.cpp: Plan.EachActivationCheckpointingKeyTurnsItOn"},
    {"activation_checkpointing.synchronize_checkpoint_boundary", N,
     "outcore's compute is synchronous per unit"},
    {"activation_checkpointing.profile", N, "outcore does not profile checkpointing"},
    {"outcore.device_memory_mb", H,
     "tests/zero/budget_test.cpp: ZeroBudget.TenthOfStateOnDeviceTrainsLikeInMemory"},
    {"outcore.swap_checksum", H,
     "tests/swap/swapper_test.cpp: Swapper.FlippedByteIsCorruptDataNamingFileAndOffset"},
    {"outcore.metrics_file", H,
     "tests/trainer/trainer_test.cpp: TrainerTest.MetricsFileHasOneRecordPerStepWithTierTraffic"},
    {"outcore.pinned_memory_mb", H,
     "tests/zero/plan_test.cpp: PlanVsActual.PeaksAndTrafficMatchThePlan"},
    {"outcore.step_in_backward", H,
     "tests/trainer/overlap_test.cpp: StepInBackwardTest.BitIdenticalToTheStepAfterBackward"},
    {"outcore.compute_dtype", H,
     "tests/trainer/trainer_test.cpp: TrainerTest.ComputeDtypeBf16RoundsEveryGemmOperand"},
    {"outcore.log_level", H,
     "tests/trainer/cli_test.cpp: TrainCliTest.LogLevelFromTheConfigSetsWhatIsLogged"},
};

// The value at dotted `path` of `j`, or nullptr.
const nlohmann::ordered_json* at_path(const nlohmann::ordered_json& j, std::string_view path) {
  const nlohmann::ordered_json* cur = &j;
  while (!path.empty()) {
    const size_t dot = path.find('.');
    const std::string key(path.substr(0, dot));
    if (!cur->is_object()) return nullptr;
    const auto it = cur->find(key);
    if (it == cur->end()) return nullptr;
    cur = &*it;
    path = dot == std::string_view::npos ? std::string_view() : path.substr(dot + 1);
  }
  return cur;
}

}  // namespace

std::span<const KeyEffect> key_effects() { return kEffects; }

std::vector<ConfigIssue> keys_without_effect(const Config& cfg,
                                             const nlohmann::ordered_json* file) {
  // The defaults this config had: overlap_comm's depends on the stage, as in DeepSpeed.
  Config base;
  base.zero_optimization.stage = cfg.zero_optimization.stage;
  base.zero_optimization.overlap_comm = cfg.zero_optimization.stage == 3;
  const nlohmann::ordered_json defaults = to_json(base);
  const nlohmann::ordered_json now = to_json(cfg);
  // The value at `path` when the config sets it to other than its default and "auto", else null.
  auto changed = [&](std::string_view path) -> const nlohmann::ordered_json* {
    const nlohmann::ordered_json* v = at_path(now, path);
    const nlohmann::ordered_json* d = at_path(defaults, path);
    if (v == nullptr || d == nullptr || *v == *d) return nullptr;
    if (v->is_string() && v->get_ref<const std::string&>() == "auto") return nullptr;
    return v;
  };
  // The same, or the value when the file writes the key (not "auto"), even at its default: a
  // key another one overrides is without effect whatever its value.
  auto written = [&](std::string_view path) -> const nlohmann::ordered_json* {
    if (const nlohmann::ordered_json* v = changed(path)) return v;
    const nlohmann::ordered_json* w = file != nullptr ? at_path(*file, path) : nullptr;
    if (w == nullptr || w->is_null() || (w->is_string() && *w == "auto")) return nullptr;
    return at_path(now, path);
  };
  std::vector<ConfigIssue> out;
  for (const KeyEffect& e : kEffects) {
    if (e.honoured) continue;
    // DeepSpeed takes bf16 moments only beside it (the parse requires it): no warning there.
    if (std::string_view(e.path) == "bf16.bf16_master_weights_and_grads" &&
        cfg.bf16.bf16_optimizer_states)
      continue;
    const nlohmann::ordered_json* v = changed(e.path);
    if (v == nullptr) continue;
    const nlohmann::ordered_json* d = at_path(defaults, e.path);
    out.push_back({std::string(e.path),
                   fmt::format("set to {}, but it has no effect in outcore: {} (default {})",
                               v->dump(), e.note, d->dump())});
  }
  // Keys honoured only where their section acts: set to another value than the default
  // elsewhere, they are said to have no effect there.
  const ZeroConfig& z = cfg.zero_optimization;
  const bool stage3 = z.stage == 3;
  const bool param_nvme = stage3 && z.offload_param.device == OffloadDevice::kNvme;
  const bool optimizer_nvme = stage3 && z.offload_optimizer.device == OffloadDevice::kNvme;
  // offload_optimizer.ratio 0 keeps every unit's optimizer state on the device: no optimizer
  // swap files for the keys that shape them (the swap directory still holds the gradient
  // accumulators where they go to NVMe).
  const bool optimizer_swapped = optimizer_nvme && z.offload_optimizer.ratio > 0;
  const char* const optimizer_swapped_where =
      "with offload_optimizer.device nvme at stage 3 and an offload_optimizer.ratio above 0 "
      "(ratio 0 keeps all the optimizer state on the device)";
  // The sections whose pin_memory the pinned pool reads (zero::pool_page_locked).
  const bool param_offloads = stage3 && z.offload_param.device != OffloadDevice::kNone;
  const bool optimizer_offloads = z.offload_optimizer.device != OffloadDevice::kNone;
  const bool bf16 = cfg.bf16.enabled.is_auto() || cfg.bf16.enabled.value_or(false);
  struct Conditional {
    const char* path;
    bool acts;
    const char* where;
  };
  // fp16's keys act with fp16 on ("auto" may turn it on), its dynamic scaler's with loss_scale 0.
  const bool fp16 = cfg.fp16.enabled.is_auto() || cfg.fp16.enabled.value_or(false);
  const bool dynamic = fp16 && cfg.fp16.dynamic_loss_scale();
  const char* const dynamic_where =
      "with fp16.enabled true and fp16.loss_scale 0 (dynamic scaling)";
  const Conditional conditional[] = {
      {"fp16.loss_scale", fp16, "with fp16.enabled true"},
      {"fp16.initial_scale_power", dynamic, dynamic_where},
      {"fp16.loss_scale_window", dynamic, dynamic_where},
      {"fp16.hysteresis", dynamic, dynamic_where},
      {"fp16.consecutive_hysteresis", dynamic, dynamic_where},
      {"fp16.min_loss_scale", dynamic, dynamic_where},
      {"outcore.step_in_backward", optimizer_swapped, optimizer_swapped_where},
      {"outcore.swap_checksum", param_nvme || optimizer_nvme,
       "where there are swap files (offload_param or offload_optimizer device nvme at stage 3)"},
      {"zero_optimization.stage3_prefetch_bucket_size", stage3, "at stage 3"},
      {"zero_optimization.stage3_param_persistence_threshold", stage3, "at stage 3"},
      {"zero_optimization.stage3_model_persistence_threshold", stage3, "at stage 3"},
      {"zero_optimization.stage3_max_live_parameters", stage3, "at stage 3"},
      {"zero_optimization.stage3_max_reuse_distance", stage3, "at stage 3"},
      {"zero_optimization.offload_param.nvme_path", param_nvme,
       "with offload_param.device nvme at stage 3"},
      {"zero_optimization.offload_param.buffer_count", param_nvme,
       "with offload_param.device nvme at stage 3"},
      {"zero_optimization.offload_param.buffer_size", param_nvme,
       "with offload_param.device nvme at stage 3"},
      {"zero_optimization.offload_param.max_in_cpu", param_nvme,
       "with offload_param.device nvme at stage 3"},
      {"zero_optimization.sub_group_size", optimizer_swapped, optimizer_swapped_where},
      {"zero_optimization.offload_optimizer.ratio",
       stage3 && z.offload_optimizer.device != OffloadDevice::kNone,
       "with offload_optimizer.device cpu or nvme at stage 3 (with none, all the optimizer "
       "state is on the device already)"},
      {"zero_optimization.offload_optimizer.nvme_path", optimizer_nvme,
       "with offload_optimizer.device nvme at stage 3"},
      {"zero_optimization.offload_optimizer.buffer_count", optimizer_swapped,
       optimizer_swapped_where},
      {"zero_optimization.offload_optimizer.pipeline_read", optimizer_swapped,
       optimizer_swapped_where},
      {"zero_optimization.offload_optimizer.pipeline_write", optimizer_swapped,
       optimizer_swapped_where},
      {"bf16.check_grad_overflow", bf16, "with bf16.enabled true"},
      {"zero_optimization.offload_param.pin_memory", param_offloads,
       "with offload_param.device cpu or nvme at stage 3 (it pins the host copies)"},
      {"zero_optimization.offload_optimizer.pin_memory", optimizer_offloads,
       "with offload_optimizer.device cpu or nvme"},
  };
  // Honoured with another meaning than DeepSpeed's, or beside a key that decides otherwise.
  if (stage3)
    for (const char* path : {"zero_optimization.stage3_param_persistence_threshold",
                             "zero_optimization.stage3_model_persistence_threshold"})
      if (const nlohmann::ordered_json* v = changed(path))
        out.push_back({path, fmt::format("set to {}: outcore compares it with a whole unit's "
                                         "elements (a decoder layer, the embedding, the head), "
                                         "not with each tensor's as DeepSpeed does",
                                         v->dump())});
  // The optimizer's lr, where the schedule sets the lr from its own keys to other values.
  const SchedulerConfig& sch = cfg.scheduler;
  const nlohmann::ordered_json* lr = written("optimizer.params.lr");
  const double lr_value = lr != nullptr && lr->is_number() ? lr->get<double>() : 0.0;
  std::string lr_set_by;
  if ((sch.type == SchedulerType::kWarmupLR || sch.type == SchedulerType::kWarmupDecayLR) &&
      !sch.warmup.warmup_max_lr.is_unset() && !sch.warmup.warmup_max_lr.is_auto() &&
      sch.warmup.warmup_max_lr.value() != lr_value)
    lr_set_by = fmt::format("scheduler {} warms up to its warmup_max_lr, {}{}",
                            sch.type == SchedulerType::kWarmupLR ? "WarmupLR" : "WarmupDecayLR",
                            sch.warmup.warmup_max_lr.value(),
                            sch.type == SchedulerType::kWarmupDecayLR ? " (default 0.001)" : "");
  else if (sch.type == SchedulerType::kOneCycle && sch.one_cycle.cycle_min_lr != lr_value &&
           sch.one_cycle.cycle_max_lr != lr_value)
    lr_set_by = "scheduler OneCycle sets the lr between its cycle_min_lr and cycle_max_lr";
  if (lr != nullptr && lr->is_number() && !lr_set_by.empty())
    out.push_back({"optimizer.params.lr",
                   fmt::format("set to {}, but {}: no effect in this config (DeepSpeed's "
                               "schedulers do the same)",
                               lr->dump(), lr_set_by)});
  if (sch.type == SchedulerType::kOneCycle && sch.one_cycle.cycle_momentum)
    if (const nlohmann::ordered_json* v = written("optimizer.params.betas"))
      out.push_back({"optimizer.params.betas",
                     fmt::format("set to {}, but scheduler OneCycle with cycle_momentum true "
                                 "sets the betas at every step: no effect in this config",
                                 v->dump())});
  if (const nlohmann::ordered_json* v = changed("activation_checkpointing.number_checkpoints"))
    out.push_back({"activation_checkpointing.number_checkpoints",
                   fmt::format("set to {}: outcore checkpoints every unit's input whatever the "
                               "number; the key, like partition_activations, turns activation "
                               "checkpointing on",
                               v->dump())});
  // One pinned pool serves both sections: page-locked only when every section that offloads
  // asks for it.
  if (param_offloads && optimizer_offloads &&
      z.offload_param.pin_memory != z.offload_optimizer.pin_memory)
    out.push_back({z.offload_param.pin_memory ? "zero_optimization.offload_optimizer.pin_memory"
                                              : "zero_optimization.offload_param.pin_memory",
                   "false while the other section's pin_memory is true: outcore keeps one pinned "
                   "pool for parameters and optimizer state, page-locked only when both are "
                   "true, so none of it is page-locked"});
  if (cfg.bf16.bf16_optimizer_states && (!cfg.bf16.enabled.value_or(false) || z.stage == 0))
    out.push_back({"bf16.bf16_optimizer_states",
                   "true without bf16 at stages 1 to 3 (where DeepSpeed applies it): outcore "
                   "keeps the Adam moments in bf16 all the same"});
  for (const Conditional& c : conditional) {
    const nlohmann::ordered_json* v = c.acts ? nullptr : changed(c.path);
    if (v == nullptr) continue;
    out.push_back({std::string(c.path),
                   fmt::format("set to {}, but it acts only {}: no effect in this config",
                               v->dump(), c.where)});
  }
  return out;
}

}  // namespace outcore::config::detail
