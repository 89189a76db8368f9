// Internal to engine/zero: ZeroEngine's implementation, a composition of one-job parts:
//   GradientPath    (gradient_path.hpp)    accumulation, all_to_all reduction, the norm
//   StepScheduler   (step_scheduler.hpp)   the step worker, expect_step, tentative steps and
//                                          their verdicts, waits for published units
//   ParamPublisher  (param_publisher.hpp)  new parameters to their tier
//   PassDriver      (pass_driver.hpp)      forward/backward and evaluation passes
//   ParamCoordinator (param_coordinator.hpp) stage 3 fetch / prefetch / release
//   OptimizerStore  (optimizer_store.hpp)  master weights and moments where they live, Adam
// engine.cpp builds them and drives a micro-batch; engine_step.cpp holds step() (norm,
// overflow, multiplier, verdict) and checkpoint access.
//
// Threads: the driving thread calls every member of Impl. The parts below are owned here and
// borrow what is declared before them (destroyed after them) and the comm lane (joined before
// they go); each part's header says which thread calls it and which lock guards its shared
// fields. Impl's own fields are set at construction and read-only after, except `accumulating`
// (the driving thread's). Beside the driving thread: device streams zero-copy (publications),
// zero-comm (host gathers' copies), zero-grad-d2h (gradient slabs down from a device the host
// cannot read), zero-fetch (stage 3) and zero-optimizer (Adam on such a device); host lanes
// zero-collectives (comm_lane), zero-fetch-wait (stage 3) and zero-grad (GradientPath); the step
// worker zero-step, with std::async tasks for concurrent NVMe unit steps; the aio threads; the two
// Executors.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "aio/aio.hpp"
#include "common/aligned_buffer.hpp"
#include "cpu_adam/cpu_adam.hpp"
#include "engine/zero/geometry.hpp"
#include "engine/zero/gradient_path.hpp"
#include "engine/zero/host_lane.hpp"
#include "engine/zero/optimizer_store.hpp"
#include "engine/zero/param_coordinator.hpp"
#include "engine/zero/param_publisher.hpp"
#include "engine/zero/pass_driver.hpp"
#include "engine/zero/plan_internal.hpp"
#include "engine/zero/step_scheduler.hpp"
#include "engine/zero/zero.hpp"
#include "swap/swap.hpp"

namespace outcore::zero {

struct ZeroEngine::Impl {
  Impl(const config::Config& cfg, const model::LlamaModel& model, device::Device& device,
       comm::Comm& comm, uint64_t seed, EngineOptions options);
  ~Impl();

  // ---- a micro-batch (engine.cpp)
  float forward_backward(const int32_t* tokens, const int32_t* targets, float loss_scale,
                         bool first);
  float evaluate(const int32_t* tokens, const int32_t* targets);

  // ---- the step and state access (engine_step.cpp)
  StepResult step(const StepParams& sp);
  // Every unit's master weights from model::init_params, and its parameters rounded from them.
  void initialise(uint64_t seed);
  void get_master_weights(int unit, std::span<float> out);
  void get_params(int unit, std::span<std::byte> out);
  void read_state(int unit, StateKind kind, std::span<float> out);
  void write_state(int unit, StateKind kind, std::span<const float> in);
  void visit_unit_state(int unit, const StateVisitor& fn);
  void fill_unit_state(int unit, const StateFiller& fn);
  void visit_param_partition(int unit, const std::function<void(std::span<const std::byte>)>& fn);
  void copy_home_partition(int unit, std::span<std::byte> own);
  void check_unit(int unit) const;

  config::Config cfg;
  const model::LlamaModel& model;
  device::Device& device;
  comm::Comm& comm;
  EngineOptions options;
  detail::Geometry g;
  Plan plan;
  PlanLimits limits_at_start;        // read before any swap file was allocated
  cpu_adam::Executor executor;       // CPU Adam (offload_optimizer.cpuadam_cores_perc)
  cpu_adam::Executor data_executor;  // the host's data path: gradient sums and norms, checksums

  std::unique_ptr<device::Stream> copy, comm_stream;
  std::unique_ptr<device::Stream> grad_d2h;      // gradient slabs down from the device
  std::unique_ptr<device::Stream> fetch_stream;  // stage 3's parameter fetches
  std::unique_ptr<swap::PinnedPool> pool;
  std::unique_ptr<aio::Engine> aio;
  std::unique_ptr<swap::SwapSpace> param_space, optimizer_space;
  std::unique_ptr<swap::Swapper> param_swapper, optimizer_swapper;
  detail::TrafficCounters traffic;
  std::unique_ptr<detail::GradientPath> grads;

  std::vector<device::DeviceBuffer> full_params;  // stage < 3: every unit's full slab
  std::unique_ptr<detail::ParamHome> home;        // stage 3
  std::unique_ptr<detail::ParamCoordinator> coordinator;
  std::unique_ptr<detail::OptimizerStore> optimizer;

  std::unique_ptr<detail::ParamPublisher> publisher;
  // max_own_len fp32: initialise's (driving thread, before any step), then the step worker's
  // (restores of a tentative step).
  AlignedBuffer scratch;
  std::unique_ptr<detail::StepScheduler> steps;
  std::unique_ptr<detail::PassDriver> passes;
  bool accumulating = false;  // gradients hold a micro-batch since the last step
  // Stage 3's fetch lane: the fetches that wait on the host (a swap read, the step gate) before
  // their copy (ParamCoordinator). Declared after what its tasks use (the step scheduler its
  // gate waits on) and before the comm lane, whose tasks wait for it.
  std::unique_ptr<detail::HostLane> fetch_lane;
  // The collectives the passes and publications issue (all_gather, all_to_all), in issue order,
  // on a thread of the engine's own (decision 025); with host gathers it also issues the comm
  // stream's copies. The driving thread's own collectives come after its wait(). Every rank
  // posts in the same order because the step worker posts (stages 1-2 publications) only while
  // the driving thread waits for that step's units, and never during the backward
  // (enable_step_in_backward refuses stages 1-2 at world > 1). Created before the parts that
  // post to it, declared last: it is joined first, while what its tasks use still exists (also
  // when the constructor throws).
  std::unique_ptr<detail::HostLane> comm_lane;
};

}  // namespace outcore::zero
