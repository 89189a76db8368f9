// The forward/backward and evaluation passes.
#include "engine/zero/pass_driver.hpp"

namespace outcore::zero::detail {

PassDriver::PassDriver(const model::LlamaModel& model,
                       std::unique_ptr<model::ActivationBuffers> acts,
                       const std::vector<device::DeviceBuffer>& full_params,
                       ParamCoordinator* coordinator, GradientPath& grads, StepScheduler& steps)
    : model_(model),
      acts_(std::move(acts)),
      full_params_(full_params),
      coordinator_(coordinator),
      grads_(grads),
      steps_(steps),
      train_sched_(train_schedule(model)),
      eval_sched_(eval_schedule(model)),
      head_(model.num_units() - 1),
      tied_(model.config().tie_word_embeddings),
      queued_(model.backend().stream() != nullptr) {}

void PassDriver::finish_compute() noexcept {
  try {
    model_.backend().finish();
  } catch (const std::exception&) {
    // The pass is failing already: its error is the one that counts.
  }
}

const void* PassDriver::params_of(int unit) const {
  return coordinator_ ? coordinator_->slab(unit) : full_params_[unit].data();
}

void PassDriver::wait_for_step(const PassStep& s) {
  steps_.wait_unit(s.unit);  // a step still publishing later units runs on
  for (int v : s.needs) steps_.wait_unit(v);
}

float PassDriver::train(const int32_t* tokens, const int32_t* targets, float loss_scale,
                        bool first) {
  try {
    return train_pass(tokens, targets, loss_scale, first);
  } catch (...) {
    finish_compute();  // nothing queued may outlive the buffers an unwinding pass frees
    throw;
  }
}

float PassDriver::evaluate(const int32_t* tokens, const int32_t* targets) {
  try {
    return evaluate_pass(tokens, targets);
  } catch (...) {
    finish_compute();
    throw;
  }
}

float PassDriver::train_pass(const int32_t* tokens, const int32_t* targets, float loss_scale,
                             bool first) {
  armed_ = steps_.arm();
  grads_.begin_pass(first);
  if (coordinator_) coordinator_->begin(&train_sched_);
  float loss = 0.0f;
  for (size_t i = 0; i < train_sched_.size(); ++i) {
    const PassStep& s = train_sched_[i];
    const int u = s.unit;
    wait_for_step(s);
    if (coordinator_) coordinator_->acquire(i);
    if (!s.backward) {
      forward(u, tokens);
      if (u != head_) acts_->after_forward(u);  // staged cpu_checkpointing: output to the host
    } else if (u == head_) {
      loss = backward_head(targets, loss_scale, first);
    } else {
      backward(u, tokens, first);
    }
    if (coordinator_) coordinator_->release(i);
  }
  model_.backend().finish();  // the pass's compute has run: its tokens may change
  grads_.drain(0);
  armed_.reset();
  if (coordinator_) coordinator_->end();
  return loss;
}

float PassDriver::evaluate_pass(const int32_t* tokens, const int32_t* targets) {
  steps_.cancel_tentative();  // the parameters of a step step() has not judged are not the model's
  model::ActivationBuffers& a = *acts_;
  if (coordinator_) coordinator_->begin(&eval_sched_);
  float loss = 0.0f;
  for (size_t i = 0; i < eval_sched_.size(); ++i) {
    const int u = eval_sched_[i].unit;
    wait_for_step(eval_sched_[i]);
    if (coordinator_) coordinator_->acquire(i);
    if (u < head_)
      forward(u, tokens);
    else
      loss = model_.forward(head_, {.params = params_of(head_),
                                    .tied_params = tied_ ? params_of(0) : nullptr,
                                    .targets = targets,
                                    .input = a.unit_input(head_),
                                    .scratch = a.scratch(),
                                    .queued = queued_});
    if (coordinator_) coordinator_->release(i);
  }
  model_.backend().finish();
  if (coordinator_) coordinator_->end();
  return loss;
}

void PassDriver::forward(int u, const int32_t* tokens) {
  model::ActivationBuffers& a = *acts_;
  if (u == 0)
    model_.forward(
        0,
        {.params = params_of(0), .tokens = tokens, .output = a.unit_input(1), .queued = queued_});
  else
    model_.forward(u, {.params = params_of(u),
                       .input = a.unit_input(u),
                       .output = a.unit_input(u + 1),
                       .saved = a.saved(u),
                       .scratch = a.scratch(),
                       .queued = queued_});
}

float PassDriver::backward_head(const int32_t* targets, float loss_scale, bool first) {
  model::ActivationBuffers& a = *acts_;
  a.before_backward(head_);
  if (tied_) tied_slab_ = grads_.alloc_slab(0);
  device::DeviceBuffer gs = grads_.alloc_slab(head_);
  const device::FinishOnUnwind finish_first(model_.backend());  // before gs goes
  const float loss = model_.backward(head_, {.params = params_of(head_),
                                             .tied_params = tied_ ? params_of(0) : nullptr,
                                             .targets = targets,
                                             .input = a.unit_input(head_),
                                             .grad_input = a.grad(),
                                             .grads = gs.as<float>(),
                                             .tied_grads = tied_ ? tied_slab_.as<float>() : nullptr,
                                             .mode = model::GradMode::Overwrite,
                                             .loss_scale = loss_scale,
                                             .scratch = a.scratch(),
                                             .queued = queued_});
  grads_.submit(head_, std::move(gs), first, steps_.when_final(armed_, head_));
  return loss;
}

void PassDriver::backward(int u, const int32_t* tokens, bool first) {
  model::ActivationBuffers& a = *acts_;
  if (u > 0) {
    a.before_backward(u);
    device::DeviceBuffer gs = grads_.alloc_slab(u);
    const device::FinishOnUnwind finish_first(model_.backend());  // before gs goes
    model_.backward(u, {.params = params_of(u),
                        .input = a.unit_input(u),
                        .grad_output = a.grad(),
                        .grad_input = a.grad(),
                        .grads = gs.as<float>(),
                        .mode = model::GradMode::Overwrite,
                        .saved = a.saved(u),
                        .scratch = a.scratch(),
                        .queued = queued_});
    grads_.submit(u, std::move(gs), first, steps_.when_final(armed_, u));
    return;
  }
  device::DeviceBuffer gs = tied_ ? std::move(tied_slab_) : grads_.alloc_slab(0);
  const device::FinishOnUnwind finish_first(model_.backend());  // before gs goes
  model_.backward(0, {.tokens = tokens,
                      .grad_output = a.grad(),
                      .grads = gs.as<float>(),
                      .mode = model::GradMode::Overwrite,
                      .queued = queued_});
  grads_.submit(0, std::move(gs), first, steps_.when_final(armed_, 0));
}

}  // namespace outcore::zero::detail
