// Internal to engine/zero: the passes over the model. A training pass runs forward 0..L, the
// head's fused loss-and-backward, backward L..0 (geometry's train_schedule), handing each
// unit's gradients to the gradient path; an evaluation runs forward only. Before each step of
// a pass it waits for the units the running optimizer step still has to publish, and at stage
// 3 the coordinator fetches (and prefetches) each unit's parameters and releases them after.
// On a backend with a stream (a GPU, the simulated discrete device) the units are queued
// without waiting for each (ForwardArgs::queued): what reads their results waits for events
// recorded on that stream (the gradient path's copies and additions, the staged checkpoints'
// copies), a stage-3 slab is freed only once the compute queued so far has run, and a pass
// returns once its compute has run.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "engine/zero/geometry.hpp"
#include "engine/zero/gradient_path.hpp"
#include "engine/zero/param_coordinator.hpp"
#include "engine/zero/step_scheduler.hpp"

namespace outcore::zero::detail {

// Owns: the activation buffers, the train and eval schedules, the tied embedding's gradient
// slab (from the head's backward to the embedding's), and the tentative step of the running
// pass.
// Borrows (must outlive it): the model, the full parameter slabs (stages 0-2), the coordinator
// (stage 3, else null), the gradient path and the step scheduler.
//
// Threads: the driving thread only; no lock (the fields are its own). The model computes on
// it; what it hands on runs on the grad, comm and fetch streams.
class PassDriver {
 public:
  PassDriver(const model::LlamaModel& model, std::unique_ptr<model::ActivationBuffers> acts,
             const std::vector<device::DeviceBuffer>& full_params, ParamCoordinator* coordinator,
             GradientPath& grads, StepScheduler& steps);

  // One training micro-batch; returns the mean cross-entropy. Arms the step during backward
  // when expect_step asked for it. first: the step's first micro-batch (the accumulators are
  // written, not added to). REQUIRES: tokens and targets non-null.
  float train(const int32_t* tokens, const int32_t* targets, float loss_scale, bool first);
  // Forward only; returns the mean cross-entropy. Undoes an unjudged tentative step first.
  float evaluate(const int32_t* tokens, const int32_t* targets);

 private:
  const void* params_of(int unit) const;
  float train_pass(const int32_t* tokens, const int32_t* targets, float loss_scale, bool first);
  float evaluate_pass(const int32_t* tokens, const int32_t* targets);
  // Waits for the compute queued so far, dropping its error (a failing pass's cleanup).
  void finish_compute() noexcept;
  // Before step `s` of a pass: the running optimizer step has published every unit it uses.
  void wait_for_step(const PassStep& s);
  // Unit u's forward without the loss (u < head in evaluation; every forward in training).
  void forward(int u, const int32_t* tokens);
  // The head's fused loss and backward (and the tied embedding's share); returns the loss.
  float backward_head(const int32_t* targets, float loss_scale, bool first);
  void backward(int u, const int32_t* tokens, bool first);

  const model::LlamaModel& model_;
  std::unique_ptr<model::ActivationBuffers> acts_;
  const std::vector<device::DeviceBuffer>& full_params_;
  ParamCoordinator* coordinator_;
  GradientPath& grads_;
  StepScheduler& steps_;
  const std::vector<PassStep> train_sched_, eval_sched_;
  const int head_;
  const bool tied_;
  const bool queued_;                     // the backend queues the units' work on its stream
  device::DeviceBuffer tied_slab_;        // the embedding's gradient slab, head to embedding
  std::shared_ptr<TentativeStep> armed_;  // the running pass's tentative step, if armed
};

}  // namespace outcore::zero::detail
