// The optimizer step's per-unit work: the step worker, the step during backward and its
// verdicts.
#include "engine/zero/step_scheduler.hpp"

#include <fmt/format.h>

#include <cmath>
#include <future>

#include "common/error.hpp"
#include "common/trace.hpp"
#include "engine/device/device.hpp"

namespace outcore::zero::detail {

cpu_adam::AdamParams adam_params(const StepParams& sp, double grad_scale) {
  cpu_adam::AdamParams hp;
  hp.lr = sp.lr;
  hp.beta1 = sp.beta1;
  hp.beta2 = sp.beta2;
  hp.eps = sp.eps;
  hp.weight_decay = sp.weight_decay;
  hp.adamw_mode = sp.adamw_mode;
  hp.bias_correction = sp.bias_correction;
  hp.step = sp.step;
  hp.grad_scale = grad_scale;
  return hp;
}

StepScheduler::StepScheduler(const Geometry& g, bool overlap_step, OptimizerStore& optimizer,
                             GradientPath& grads, ParamPublisher& publisher,
                             std::span<float> scratch)
    : g_(g),
      overlap_step_(overlap_step),
      optimizer_(optimizer),
      grads_(grads),
      publisher_(publisher),
      scratch_(scratch) {}

StepScheduler::~StepScheduler() { stop(); }

void StepScheduler::stop() {
  if (!worker_.joinable()) return;  // idle now: finish() waited for it
  {
    std::lock_guard lock(m_);
    quit_ = true;
  }
  cv_.notify_all();
  worker_.join();
}

void StepScheduler::start_worker() {
  if (!worker_.joinable()) worker_ = std::thread([this] { worker_loop(); });
}

// ---- the step after the backward ------------------------------------------------------------

void StepScheduler::start(const cpu_adam::AdamParams& hp) {
  {
    std::lock_guard lock(m_);
    done_.assign(g_.units.size(), 0);
    active_ = true;
    error_ = nullptr;
  }
  if (!overlap_step_) {
    run_unit_steps(hp);
    join();
    return;
  }
  start_worker();
  {
    std::lock_guard lock(m_);
    job_ = hp;
    running_ = true;
  }
  cv_.notify_all();
}

void StepScheduler::worker_loop() {
  trace::name_thread("zero-step");
  std::unique_lock lock(m_);
  for (;;) {
    cv_.wait(lock, [&] { return quit_ || job_.has_value() || !tentative_jobs_.empty(); });
    std::exception_ptr error;
    if (job_) {
      const cpu_adam::AdamParams hp = *job_;
      job_.reset();
      lock.unlock();
      try {
        run_unit_steps(hp);
      } catch (...) {
        error = std::current_exception();
      }
      lock.lock();
      if (error) error_ = error;
      running_ = false;
      cv_.notify_all();
      continue;
    }
    if (!tentative_jobs_.empty()) {
      std::shared_ptr<TentativeStep> t = std::move(tentative_jobs_.front());
      tentative_jobs_.pop_front();
      lock.unlock();
      try {
        run_tentative(*t);
      } catch (...) {
        error = std::current_exception();
      }
      lock.lock();
      if (error) error_ = error;
      t->ended = true;
      if (t->verdict == TentativeStep::Verdict::kCommit ||
          t->verdict == TentativeStep::Verdict::kRedo)
        running_ = false;  // it was this step's run
      cv_.notify_all();
      continue;
    }
    return;  // quit
  }
}

void StepScheduler::mark_done(int unit) {
  std::lock_guard lock(m_);
  done_.at(static_cast<size_t>(unit)) = 1;
  cv_.notify_all();
}

bool StepScheduler::pending(int unit) {
  std::lock_guard lock(m_);
  return active_ && !done_[static_cast<size_t>(unit)] && error_ == nullptr;
}

void StepScheduler::wait_unit(int unit) {
  if (device::in_host_function())
    throw Error(
        fmt::format("the optimizer step of unit {} was waited for in a host function of a device "
                    "stream",
                    unit));
  std::unique_lock lock(m_);
  if (!active_) return;
  const size_t u = static_cast<size_t>(unit);
  cv_.wait(lock, [&] { return done_[u] || error_ != nullptr; });
  if (!done_[u]) std::rethrow_exception(error_);
}

void StepScheduler::finish() {
  cancel_tentative();
  join();
}

void StepScheduler::join() {
  std::unique_lock lock(m_);
  cv_.wait(lock, [&] { return !running_; });
  if (!active_) return;
  if (error_) std::rethrow_exception(error_);  // the engine is unusable now
  active_ = false;
}

void StepScheduler::run_unit_steps(const cpu_adam::AdamParams& hp) {
  const size_t U = g_.units.size();
  std::vector<char> done;
  {
    std::lock_guard lock(m_);
    done = done_;
  }
  size_t u = 0;
  auto next = [&]() -> int {
    while (u < U && done[u]) ++u;  // stepped during the backward
    return u < U ? static_cast<int>(u++) : -1;
  };
  // A unit is done when its new parameters are where the next pass reads them.
  auto complete = [&](int unit, size_t slot) {
    publisher_.wait_landed(unit, slot);
    mark_done(unit);
  };
  step_units(hp, next, /*tentative=*/false, complete);
  publisher_.wait_all();
  std::lock_guard lock(m_);
  std::fill(done_.begin(), done_.end(), 1);
  cv_.notify_all();
}

void StepScheduler::step_units(const cpu_adam::AdamParams& hp, const std::function<int()>& next,
                               bool tentative, const std::function<void(int, size_t)>& complete) {
  const DType dt = g_.placement.param_dtype;
  const size_t slots = publisher_.slot_count();
  const size_t concurrent = optimizer_.concurrent_steps();
  // Gradient slots: slot 0 accumulates; a tentative step runs beside that pass.
  const size_t grad_slots = grads_.slot_count();
  auto grad_slot = [&](size_t k) {
    return tentative && grad_slots > 1 ? 1 + k % (grad_slots - 1) : k;
  };
  auto run_one = [this, &hp, dt, tentative](int unit, size_t gslot, void* out) {
    const float* grads = grads_.load(unit, gslot);
    if (tentative)
      optimizer_.step_tentative(unit, grads, hp, out, dt);
    else
      optimizer_.step(unit, grads, hp, out, dt);
  };
  if (concurrent <= 1) {
    for (size_t k = 0;; ++k) {
      const int unit = next();
      if (unit < 0) break;
      publisher_.publish(
          unit, k % slots, [&](std::byte* out) { run_one(unit, grad_slot(k), out); },
          ParamPublisher::Writer::kOptimizer);
      complete(unit, k % slots);
    }
    return;
  }
  // Units step on worker threads, `concurrent` at a time (NVMe reads of one overlap the Adam
  // of another); publications are issued here, in the order `next` gave.
  struct Running {
    int unit;
    size_t slot;
    bool staged;
    std::future<void> done;
  };
  std::deque<Running> running;
  auto finish_front = [&] {
    Running f = std::move(running.front());
    running.pop_front();
    f.done.get();
    publisher_.finish(f.unit, f.slot, f.staged);
    complete(f.unit, f.slot);
  };
  try {
    for (size_t k = 0;; ++k) {
      if (running.size() >= concurrent) finish_front();
      const int unit = next();
      if (unit < 0) break;
      Running rn{unit, k % slots, false, {}};
      std::byte* out =
          publisher_.target(unit, rn.slot, rn.staged, ParamPublisher::Writer::kOptimizer);
      const size_t gslot = grad_slot(k);
      rn.done = std::async(std::launch::async,
                           [&run_one, unit, gslot, out] { run_one(unit, gslot, out); });
      running.push_back(std::move(rn));
    }
    while (!running.empty()) finish_front();
  } catch (...) {
    for (Running& f : running)
      if (f.done.valid()) f.done.wait();
    throw;
  }
}

// ---- the step during backward ---------------------------------------------------------------

void StepScheduler::expect(const StepParams& sp) {
  if (!g_.step_in_backward || !overlap_step_) return;
  const bool clipping = sp.gradient_clipping > 0;
  std::lock_guard lock(m_);
  expected_.reset();
  if (clipping && !last_unclipped_) return;  // clipping is likely: step after backward
  expected_ = sp;
}

std::shared_ptr<TentativeStep> StepScheduler::arm() {
  cancel_tentative();  // a pass after an armed one: its tentative step cannot stand
  std::lock_guard lock(m_);
  if (!expected_) return nullptr;
  const StepParams sp = *expected_;
  expected_.reset();
  if (!(sp.loss_scale > 0) || !std::isfinite(sp.loss_scale)) return nullptr;
  auto t = std::make_shared<TentativeStep>();
  t->hp = adam_params(sp, unscale_and_clip_multiplier(0.0, sp.loss_scale, 0.0));
  cpu_adam::validate(t->hp);
  start_worker();
  open_ = t;
  tentative_jobs_.push_back(t);
  cv_.notify_all();
  return t;
}

std::function<void()> StepScheduler::when_final(const std::shared_ptr<TentativeStep>& t, int unit) {
  if (!t || !optimizer_.can_step_tentatively(unit)) return {};
  // The pass is the step's last: once the gradient lane gets here the unit's gradients are
  // final, and the step worker may start its Adam.
  std::shared_ptr<TentativeStep> posted = t;
  return [this, posted, unit] {
    {
      std::lock_guard lock(m_);
      posted->posted.push_back(unit);
    }
    cv_.notify_all();
  };
}

std::shared_ptr<TentativeStep> StepScheduler::open_tentative() {
  std::lock_guard lock(m_);
  expected_.reset();
  return open_;
}

StepResult::InBackward StepScheduler::judge(TentativeStep& t, const cpu_adam::AdamParams* hp) {
  using Verdict = TentativeStep::Verdict;
  // The units stepped during the backward used the multiplier without clipping: they stand
  // if the step's parameters are exactly those, else every unit is stepped again from the
  // state kept (or, on overflow, its parameters are rounded again from it).
  std::unique_lock lock(m_);
  open_.reset();  // judged here
  StepResult::InBackward r;
  if (hp == nullptr) {
    t.verdict = Verdict::kRestore;
    r = StepResult::InBackward::kRestored;
  } else {
    t.verdict = *hp == t.hp ? Verdict::kCommit : Verdict::kRedo;
    r = t.verdict == Verdict::kCommit ? StepResult::InBackward::kCommitted
                                      : StepResult::InBackward::kRedone;
    t.final_hp = *hp;
    done_.assign(g_.units.size(), 0);
    active_ = true;
    error_ = nullptr;
    running_ = true;  // run_tentative finishes this step
  }
  cv_.notify_all();
  if (hp == nullptr) {
    cv_.wait(lock, [&] { return t.ended; });
    if (error_) std::rethrow_exception(error_);
  }
  return r;
}

void StepScheduler::cancel_tentative() {
  std::unique_lock lock(m_);
  std::shared_ptr<TentativeStep> t = std::move(open_);
  open_.reset();
  if (!t) return;
  t->verdict = TentativeStep::Verdict::kRestore;
  cv_.notify_all();
  cv_.wait(lock, [&] { return t->ended; });
}

void StepScheduler::restore_params(int unit, size_t slot) {
  const UnitGeometry& ug = g_.units[unit];
  float* master = scratch_.data();
  optimizer_.read(unit, StateKind::kMaster, {master, ug.own_len});
  const DType dt = g_.placement.param_dtype;
  publisher_.publish(unit, slot,
                     [&](std::byte* out) { to_param_dtype(master, out, dt, ug.own_len); });
  publisher_.wait_all();  // the next unit reuses `master`
}

void StepScheduler::run_tentative(TentativeStep& t) {
  using Verdict = TentativeStep::Verdict;
  const cpu_adam::AdamParams& hp = t.hp;
  // Phase 1: units in the order their gradients become final, until the verdict.
  auto next = [&]() -> int {
    std::unique_lock lock(m_);
    cv_.wait(lock, [&] { return !t.posted.empty() || t.verdict != Verdict::kOpen; });
    if (t.verdict != Verdict::kOpen) return -1;  // the rest in unit order (or not at all)
    const int unit = t.posted.front();
    t.posted.pop_front();
    t.written.push_back(unit);
    return unit;
  };
  auto complete = [&](int unit, size_t slot) {
    publisher_.wait_landed(unit, slot);
    std::unique_lock lock(m_);
    if (t.verdict == Verdict::kOpen) return t.finished.push_back(unit);
    const Verdict v = t.verdict;
    lock.unlock();
    if (v != Verdict::kCommit) return optimizer_.discard(unit);
    optimizer_.commit(unit);
    mark_done(unit);
  };
  std::exception_ptr error;
  try {
    step_units(hp, next, /*tentative=*/true, complete);
  } catch (...) {
    error = std::current_exception();
  }
  Verdict v;
  {
    std::unique_lock lock(m_);
    cv_.wait(lock, [&] { return t.verdict != Verdict::kOpen; });
    v = t.verdict;
  }
  // Phase 2: the verdict. Every unit still pending is committed or discarded first, so a
  // failure leaves no tentative state behind.
  for (int unit : t.finished) {
    if (v == Verdict::kCommit) {
      optimizer_.commit(unit);
      mark_done(unit);
    } else {
      optimizer_.discard(unit);
    }
  }
  const std::vector<int> written = std::move(t.written);
  cpu_adam::AdamParams final_hp;
  {
    std::lock_guard lock(m_);
    final_hp = t.final_hp;
  }
  if (error) std::rethrow_exception(error);
  if (v == Verdict::kRestore) {
    const size_t slots = publisher_.slot_count();
    for (size_t k = 0; k < written.size(); ++k) restore_params(written[k], k % slots);
    return;
  }
  if (v == Verdict::kRedo) {
    std::lock_guard lock(m_);
    done_.assign(g_.units.size(), 0);
  }
  run_unit_steps(final_hp);
}

}  // namespace outcore::zero::detail
