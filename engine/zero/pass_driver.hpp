// Internal to engine/zero: the passes over the model. A training pass runs forward 0..L, the
// head's fused loss-and-backward, backward L..0 (geometry's train_schedule), handing each
// unit's gradients to the gradient path; an evaluation runs forward only. Before each step of
// a pass it waits for the units the running optimizer step still has to publish, and at stage
// 3 the coordinator fetches (and prefetches) each unit's parameters and releases them after.
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
  device::DeviceBuffer tied_slab_;        // the embedding's gradient slab, head to embedding
  std::shared_ptr<TentativeStep> armed_;  // the running pass's tentative step, if armed
};

}  // namespace outcore::zero::detail
