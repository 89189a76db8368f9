// Internal to engine/zero: the per-unit work of the optimizer step (Adam where each unit's
// state lives, then publication of its new parameters), scheduled after step()'s norm and
// verdict: inline (overlap_step false), on the step worker under the next pass (decision
// 001), or tentatively during the backward and judged by step() (decision 002).
#pragma once

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <thread>
#include <vector>

#include "cpu_adam/cpu_adam.hpp"
#include "engine/zero/geometry.hpp"
#include "engine/zero/gradient_path.hpp"
#include "engine/zero/optimizer_store.hpp"
#include "engine/zero/param_publisher.hpp"
#include "engine/zero/zero.hpp"

namespace outcore::zero::detail {

// The Adam parameters of a step with multiplier `grad_scale`.
cpu_adam::AdamParams adam_params(const StepParams& sp, double grad_scale);

// The tentative step of one armed pass (outcore.step_in_backward). Shared by the pass (which
// posts units from the gradient lane), step() (which judges it) and the step worker.
struct TentativeStep {
  enum class Verdict { kOpen, kCommit, kRedo, kRestore };
  // Set by arm() before the worker sees it; constant after.
  cpu_adam::AdamParams hp;  // the step's parameters with the multiplier without clipping
  // Guarded by StepScheduler's m_:
  std::deque<int> posted;  // gradients final, not taken yet (pushed from the gradient lane)
  Verdict verdict = Verdict::kOpen;
  cpu_adam::AdamParams final_hp;  // kCommit / kRedo: the step's parameters
  bool ended = false;             // run_tentative returned
  // The step worker's only:
  std::vector<int> finished;  // stepped, awaiting the verdict
  std::vector<int> written;   // parameters overwritten by a tentative step
};

// Owns: the step worker thread ("zero-step", started on first use, kept for the engine's
// life), which units of the running step are published, its error, the job posted to the
// worker, and the tentative steps.
// Borrows (must outlive it): the geometry, the optimizer store, the gradient path (reads
// gradients), the publisher, and a scratch buffer of max_own_len floats (restores).
//
// Threads: the driving thread calls every public member; the closure when_final() returns runs
// on the gradient path's host lane (zero-grad, after the unit's gradients are added). The
// private members run on the step worker (run_unit_steps also inline on the driving thread when
// overlap_step is false), and step_units' Adam on std::async tasks. One mutex m_ with one condition
// variable cv_ guards the fields marked below; the worker holds it only to take work or publish
// progress, never while stepping or publishing.
class StepScheduler {
 public:
  StepScheduler(const Geometry& g, bool overlap_step, OptimizerStore& optimizer,
                GradientPath& grads, ParamPublisher& publisher, std::span<float> scratch);
  // Stops the worker (call finish() first: its errors are the caller's).
  ~StepScheduler();
  // Tells the idle worker to quit and joins it. REQUIRES: no step running (finish() returned).
  void stop();

  // ---- the step during backward
  // Records the step the trainer will take after the next pass, when the step during backward
  // applies and the multiplier without clipping is likely (no clipping, or the last step was
  // not clipped); otherwise forgets any expected step.
  void expect(const StepParams& sp);
  // At the start of a training pass: undoes an earlier pass's tentative step, then arms this
  // pass when expect() asked for it (null: not armed).
  std::shared_ptr<TentativeStep> arm();
  // What the gradient lane runs after `unit`'s last accumulation in the armed pass `t`: posts
  // the unit to the worker. Empty when `t` is null or the unit's state cannot step tentatively.
  std::function<void()> when_final(const std::shared_ptr<TentativeStep>& t, int unit);
  // In step(): the pass's tentative step, left open until judge() (null if none); forgets the
  // expected step.
  std::shared_ptr<TentativeStep> open_tentative();
  // The verdict on `t`: hp null (overflow) -> restore, waited for, rethrowing its error;
  // *hp equal to the tentative parameters -> commit, else redo; both finish on the worker
  // under the next pass.
  StepResult::InBackward judge(TentativeStep& t, const cpu_adam::AdamParams* hp);
  // Undoes a tentative step no step() will judge (parameters rounded again from the
  // unchanged master weights) and waits for it.
  void cancel_tentative();
  // Whether the last applied step's multiplier had no clipping (the policy of expect()).
  void note_multiplier(bool unclipped) { last_unclipped_ = unclipped; }

  // ---- the step after the backward
  // Steps and publishes every unit with `hp`: inline when overlap_step is false, else on the
  // worker, returning at once.
  void start(const cpu_adam::AdamParams& hp);
  // Whether wait_unit(unit) would block now (the running step still has to publish the unit).
  bool pending(int unit);
  // Blocks until `unit`'s update of the running step is published; rethrows its error.
  // Never from a host function of a device stream (Error): on a GPU that would hold
  // CUDA's one callback thread while the step's own device work, which it waits for, may be
  // queued behind it.
  void wait_unit(int unit);
  // Waits for the running step (if any); rethrows its error (the engine is unusable then).
  void join();
  // cancel_tentative(), then join().
  void finish();

 private:
  void worker_loop();
  void start_worker();  // REQUIRES: m_ held or the worker not running
  // The per-unit updates of one step in unit order, skipping units already done.
  void run_unit_steps(const cpu_adam::AdamParams& hp);
  // Steps the units `next()` yields (-1: no more), optimizer concurrent_steps() at a time,
  // publishing in that order; `complete(unit, slot)` runs once a unit's publication is
  // issued. tentative: step_tentative instead of step, gradients in grad slots 1.. (slot 0
  // accumulates the pass still running).
  void step_units(const cpu_adam::AdamParams& hp, const std::function<int()>& next, bool tentative,
                  const std::function<void(int unit, size_t slot)>& complete);
  void run_tentative(TentativeStep& t);
  void restore_params(int unit, size_t slot);
  void mark_done(int unit);

  const Geometry& g_;
  const bool overlap_step_;
  OptimizerStore& optimizer_;
  GradientPath& grads_;
  ParamPublisher& publisher_;
  const std::span<float> scratch_;  // the worker's (restores)

  std::mutex m_;
  std::condition_variable cv_;  // every change of a field guarded by m_
  // Guarded by m_:
  std::vector<char> done_;  // per unit: its new parameters are published
  bool active_ = false;     // a step's updates are (or were) running
  std::exception_ptr error_;
  std::optional<cpu_adam::AdamParams> job_;  // posted by start(), taken by the worker
  bool running_ = false;                     // the worker has a step to finish
  bool quit_ = false;
  std::deque<std::shared_ptr<TentativeStep>> tentative_jobs_;  // for the worker, in order
  std::shared_ptr<TentativeStep> open_;  // the pass's tentative step, until judged
  std::optional<StepParams> expected_;   // expect(), for the next pass
  // The driving thread's only:
  bool last_unclipped_ = false;  // the last step's multiplier had no clipping
  std::thread worker_;           // started and joined by the driving thread
};

}  // namespace outcore::zero::detail
