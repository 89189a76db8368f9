// Internal to engine/zero: ZeroEngine's state, shared by engine.cpp (construction, passes),
// engine_step.cpp (the optimizer step, parameter publication, state access).
#pragma once

#include <condition_variable>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "aio/aio.hpp"
#include "common/aligned_buffer.hpp"
#include "cpu_adam/cpu_adam.hpp"
#include "engine/zero/geometry.hpp"
#include "engine/zero/optimizer_store.hpp"
#include "engine/zero/param_coordinator.hpp"
#include "engine/zero/plan_internal.hpp"
#include "engine/zero/zero.hpp"
#include "swap/swap.hpp"

namespace outcore::zero {

struct ZeroEngine::Impl {
  Impl(const config::Config& cfg, const model::LlamaModel& model, device::Device& device,
       comm::Comm& comm, uint64_t seed, EngineOptions options);
  ~Impl();

  // ---- passes (engine.cpp)
  float forward_backward(const int32_t* tokens, const int32_t* targets, float loss_scale,
                         bool first);
  float evaluate(const int32_t* tokens, const int32_t* targets);
  const void* params_of(int unit) const;
  device::DeviceBuffer alloc_grad_slab(int unit);
  void submit_grads(int unit, device::DeviceBuffer slab, bool first);
  void drain_grads(size_t keep);
  // The step's global sum of squares of the reduced gradients (collective).
  double gradient_sum_of_squares();

  // ---- step and state (engine_step.cpp)
  StepResult step(const StepParams& sp);
  // The per-unit Adam updates and publications of one step, in unit order; each unit is
  // marked done once its new parameters are in place (written, copied, gathered).
  void run_unit_steps(const cpu_adam::AdamParams& hp);
  void mark_done(size_t units);
  // Blocks until `unit`'s update of the running step is published; rethrows its error.
  void wait_unit(int unit);
  // Whether wait_unit(unit) would block now (a step still has to publish the unit).
  bool unit_pending(int unit);
  // Joins the running step (if any); rethrows its error.
  void finish_step();
  // Writes own_len new low-precision elements of `unit` (produced by `produce(out)`) to the
  // parameters' tier, in order with other publications; `slot` picks the staging buffer.
  template <typename Produce>
  void publish(int unit, size_t slot, Produce&& produce);
  std::byte* publish_target(int unit, size_t slot, bool& staged);
  void finish_publish(int unit, size_t slot, bool staged);
  void wait_slot(size_t slot);
  void wait_publications();
  void initialise(uint64_t seed);
  float* grad_partition(int unit);
  float* grad_accumulator(int unit);
  // The unit's reduced fp32 gradients for its Adam step (read from NVMe into grad buffer
  // `slot` when they live there).
  const float* load_grads(int unit, size_t slot);
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
  PlanLimits limits_at_start;  // read before any swap file was allocated
  cpu_adam::Executor executor;
  std::vector<detail::PassStep> train_sched, eval_sched;

  std::unique_ptr<device::Stream> copy, grad, comm_stream;
  std::unique_ptr<device::Stream> fetch_stream;  // stage 3's parameter fetches
  std::unique_ptr<swap::PinnedPool> pool;
  std::unique_ptr<aio::Engine> aio;
  std::unique_ptr<swap::SwapSpace> param_space, optimizer_space;
  std::unique_ptr<swap::Swapper> param_swapper, optimizer_swapper;
  std::unique_ptr<swap::SwapSpace> grad_space;  // gradient accumulators on NVMe
  std::unique_ptr<swap::Swapper> grad_swapper;
  std::vector<swap::TensorId> grad_ids;
  std::vector<swap::PinnedBuffer> grad_buffers;  // [0]: accumulation; [k]: unit steps
  swap::PinnedBuffer grad_copy_back;             // gradient slabs of a device the host cannot read
  // Several ranks on such a device: parameters are gathered here, then copied up whole.
  swap::PinnedBuffer param_gather;
  // The gradient norm's partial sums of squares, one per detail::kNormBlock elements of this
  // rank's reduced partitions, unit after unit (norm_block_off[u]: unit u's first). Summed
  // in slab order across ranks, so the norm does not depend on the world size.
  std::vector<double> norm_blocks;
  std::vector<size_t> norm_block_off;
  detail::TrafficCounters traffic;

  std::unique_ptr<model::ActivationBuffers> acts;
  std::vector<device::DeviceBuffer> full_params;  // stage < 3: every unit's full slab
  std::unique_ptr<detail::ParamHome> home;        // stage 3
  std::unique_ptr<detail::ParamCoordinator> coordinator;
  std::vector<device::DeviceBuffer> device_accum;  // gradients on the device
  std::vector<AlignedBuffer> host_accum;           // gradients in host memory
  std::unique_ptr<detail::OptimizerStore> optimizer;

  // Staging for publications (new parameters after Adam): buffer, and what still uses it.
  struct PublishSlot {
    swap::PinnedBuffer buf;
    std::unique_ptr<device::Event> copied;
    bool copy_pending = false;
    swap::SwapTicket write;
  };
  std::vector<PublishSlot> publish_slots;
  std::unique_ptr<device::Event> comm_done;
  AlignedBuffer scratch;  // max_own_len fp32

  struct InFlightGrad {
    device::DeviceBuffer slab;
    std::unique_ptr<device::Event> reduced, done;
    std::unique_ptr<device::Event> copied;  // back in host memory (device the host cannot read)
  };
  std::deque<InFlightGrad> in_flight;

  // The optimizer step running under the next pass (EngineOptions::overlap_step), on one
  // worker thread kept for the engine's life (one "zero-step" track in a trace).
  struct StepRun {
    std::mutex m;
    std::condition_variable cv;
    size_t units_done = 0;  // units whose new parameters are published, in unit order
    bool active = false;    // a step's updates are (or were) running on `worker`
    std::exception_ptr error;
    std::optional<cpu_adam::AdamParams> job;  // posted by step(), taken by the worker
    bool running = false;                     // the worker has a step to finish
    bool quit = false;
    std::thread worker;
  } step_run;
  void step_worker();              // the worker's loop
  device::DeviceBuffer tied_slab;  // the embedding's gradient slab, head to embedding backward
  bool accumulating = false;       // gradients hold a micro-batch since the last step
};

}  // namespace outcore::zero
