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
  // The per-unit Adam updates and publications of one step, in unit order, skipping units
  // already done; each unit is marked done once its new parameters are in place (written,
  // copied, gathered).
  void run_unit_steps(const cpu_adam::AdamParams& hp);
  // Steps the units `next()` yields (-1: no more), optimizer->concurrent_steps() at a time,
  // publishing in that order; `complete(unit, slot)` runs once a unit's publication is
  // issued. tentative: step_tentative instead of step, gradients in grad slots 1.. (slot 0
  // accumulates the pass still running).
  void step_units(const cpu_adam::AdamParams& hp, const std::function<int()>& next, bool tentative,
                  const std::function<void(int unit, size_t slot)>& complete);
  void mark_done(int unit);
  // ---- the step during backward (outcore.step_in_backward)
  void expect_step(const StepParams& sp);
  // Undoes a tentative step that no step() will judge (parameters rounded again from the
  // unchanged master weights) and waits for it.
  void cancel_tentative();
  void restore_params(int unit, size_t slot);
  // Blocks until `unit`'s update of the running step is published; rethrows its error.
  void wait_unit(int unit);
  // Whether wait_unit(unit) would block now (a step still has to publish the unit).
  bool unit_pending(int unit);
  // Undoes a tentative step step() has not judged, then joins the running step (if any);
  // rethrows its error.
  void finish_step();
  void join_step();  // the join alone
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
    std::vector<char> done;  // per unit: its new parameters are published
    bool active = false;     // a step's updates are (or were) running on `worker`
    std::exception_ptr error;
    std::optional<cpu_adam::AdamParams> job;  // posted by step(), taken by the worker
    bool running = false;                     // the worker has a step to finish
    bool quit = false;
    std::thread worker;
    // The step during backward: expect_step arms the next pass; its grad stream posts units
    // whose gradients are final; the worker steps them tentatively until step() gives the
    // verdict (cancel_tentative: kRestore).
    enum class Verdict { kOpen, kCommit, kRedo, kRestore };
    struct Tentative {
      cpu_adam::AdamParams hp;  // the step's parameters with the multiplier without clipping
      std::deque<int> posted;   // gradients final, not taken yet
      Verdict verdict = Verdict::kOpen;
      cpu_adam::AdamParams final_hp;  // kCommit / kRedo: the step's parameters
      std::vector<int> finished;      // stepped, awaiting the verdict (worker only)
      std::vector<int> written;       // parameters overwritten by a tentative step (worker only)
      bool ended = false;             // run_tentative returned
    };
    std::deque<std::shared_ptr<Tentative>> tentative_jobs;  // for the worker, in order
    std::shared_ptr<Tentative> open;     // the pass's tentative step, until step() judges it
    std::optional<StepParams> expected;  // expect_step, for the next pass
    bool last_unclipped = false;         // the last step's multiplier had no clipping
  } step_run;
  void step_worker();  // the worker's loop
  // forward_backward: arms the pass when expect_step asked for it (null: not armed).
  std::shared_ptr<StepRun::Tentative> arm_tentative();
  std::shared_ptr<StepRun::Tentative> pass_tentative;  // the running pass's, if armed
  void post_when_final(int unit);             // grad stream, after the unit's last accumulation
  void run_tentative(StepRun::Tentative& t);  // on the step worker
  device::DeviceBuffer tied_slab;  // the embedding's gradient slab, head to embedding backward
  bool accumulating = false;       // gradients hold a micro-batch since the last step
};

}  // namespace outcore::zero
