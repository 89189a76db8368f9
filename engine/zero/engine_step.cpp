// ZeroEngine: the optimizer step, publication of new parameters to their tier, and access to
// the training state.
#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <deque>
#include <future>

#include "common/error.hpp"
#include "common/trace.hpp"
#include "engine/zero/engine_impl.hpp"

namespace outcore::zero {
namespace {

void to_param_dtype(const float* src, void* dst, DType dtype, size_t n) {
  if (dtype == DType::F32)
    std::memcpy(dst, src, n * sizeof(float));
  else
    model::convert_from_fp32(src, dst, dtype, n);
}

}  // namespace

StepParams step_params(const config::Config& cfg, double lr, uint64_t step, double loss_scale) {
  const config::OptimizerConfig& o = cfg.optimizer;
  StepParams p;
  p.lr = lr;
  const std::array<double, 2> betas = o.betas.value_or({0.9, 0.999});
  p.beta1 = betas[0];
  p.beta2 = betas[1];
  p.eps = o.eps.value_or(1e-8);
  p.weight_decay = o.weight_decay.value_or(0.0);
  p.adamw_mode = o.decoupled_weight_decay();
  p.bias_correction = o.bias_correction;
  p.step = step;
  p.loss_scale = loss_scale;
  p.gradient_clipping = cfg.gradient_clipping.value_or(1.0);
  const bool fp16 = cfg.fp16.enabled.value_or(false);
  const bool bf16 = cfg.bf16.enabled.value_or(false);
  p.check_overflow = fp16 || (bf16 && cfg.bf16.check_grad_overflow);
  return p;
}

double unscale_and_clip_multiplier(double grad_norm, double loss_scale, double clip,
                                   int world_size) {
  if (!(loss_scale > 0) || !std::isfinite(loss_scale)) {
    throw InvalidArgument(fmt::format("loss scale {} must be a finite number > 0", loss_scale));
  }
  if (!(clip >= 0) || !std::isfinite(clip)) {
    throw InvalidArgument(fmt::format("gradient_clipping {} must be a finite number >= 0", clip));
  }
  if (world_size < 1) throw InvalidArgument(fmt::format("world size {} < 1", world_size));
  double combined = loss_scale;
  if (clip > 0 && std::isfinite(grad_norm)) {
    const double c = (grad_norm + 1e-6) / clip;
    if (c > 1) combined = c * loss_scale;
  }
  return 1.0 / (combined * static_cast<double>(world_size));
}

void ZeroEngine::Impl::check_unit(int unit) const {
  if (unit < 0 || unit >= static_cast<int>(g.units.size()))
    throw InvalidArgument(
        fmt::format("zero: unit {} does not exist (the model has {} units)", unit, g.units.size()));
}

const float* ZeroEngine::Impl::load_grads(int unit, size_t slot) {
  if (g.placement.gradients != Tier::kNvme) return grad_partition(unit);
  swap::PinnedBuffer& b = grad_buffers.at(slot % grad_buffers.size());
  grad_swapper->read(grad_ids[unit], {b.data(), g.units[unit].accum_len * sizeof(float)});
  return b.as<float>().data();
}

float* ZeroEngine::Impl::grad_partition(int unit) {
  float* acc = grad_accumulator(unit);
  return g.placement.stage <= 1 ? acc + g.units[unit].own_off : acc;
}

// ---- publication of new low-precision parameters --------------------------------------------

void ZeroEngine::Impl::wait_slot(size_t slot) {
  PublishSlot& s = publish_slots[slot];
  if (s.copy_pending) {
    s.copy_pending = false;
    s.copied->synchronize();
  }
  if (s.write.valid()) {
    const swap::SwapTicket t = s.write;
    s.write = {};
    home->swapper()->wait(t);
  }
}

void ZeroEngine::Impl::wait_publications() {
  for (size_t k = 0; k < publish_slots.size(); ++k) wait_slot(k);
  copy->synchronize();
  comm_stream->synchronize();
}

// Where the new own elements of `unit` are written: straight into the parameters' home when
// the optimizer can write there, else into staging slot `slot` (then copied or swapped out).
std::byte* ZeroEngine::Impl::publish_target(int unit, size_t slot, bool& staged) {
  const detail::UnitGeometry& ug = g.units[unit];
  staged = detail::staged_publication(g.placement, static_cast<size_t>(unit));
  if (!staged)
    return g.placement.stage < 3 ? full_params[unit].as<std::byte>() + ug.own_off * g.param_bytes
                                 : home->resident(unit);
  wait_slot(slot);
  return publish_slots.at(slot).buf.data();
}

void ZeroEngine::Impl::finish_publish(int unit, size_t slot, bool staged) {
  const Placement& p = g.placement;
  const detail::UnitGeometry& ug = g.units[unit];
  const size_t bytes = ug.own_len * g.param_bytes;
  PublishSlot* s = staged ? &publish_slots.at(slot) : nullptr;
  const bool host_gather = g.host_gathers_publications();
  if (staged) {
    if (p.stage == 3 && home->tier(unit) == Tier::kNvme) {
      s->write = home->start_write(unit, s->buf.data());
    } else if (!host_gather) {
      std::byte* dst = p.stage < 3 ? full_params[unit].as<std::byte>() + ug.own_off * g.param_bytes
                                   : home->resident(unit);
      copy->copy_h2d(dst, s->buf.data(), bytes);
      traffic.h2d += bytes;
      copy->record(*s->copied);
      s->copy_pending = true;
    }
  }
  if (host_gather) {
    // The device's memory is not the host's: gather in pinned memory (the comm stream runs
    // one gather at a time, so one buffer serves), then copy the whole slab up. Staged is
    // true here (the parameters' home is the device, the optimizer's is not).
    std::byte* gather = param_gather.data();
    const std::byte* src = s->buf.data();
    const size_t full_bytes = ug.padded * g.param_bytes;
    comm::Comm* c = &comm;
    comm_stream->enqueue([c, src, gather, bytes, full_bytes] {
      c->all_gather_bytes({src, bytes}, {gather, full_bytes});
    });
    comm_stream->copy_h2d(full_params[unit].data(), gather, full_bytes);
    traffic.h2d += full_bytes;
    comm_stream->record(*s->copied);
    s->copy_pending = true;
    return;
  }
  if (p.stage == 1 || p.stage == 2) {
    // Every rank holds the full slab: gather the other ranks' new partitions.
    std::byte* full = full_params[unit].as<std::byte>();
    std::byte* own = full + ug.own_off * g.param_bytes;
    const size_t full_bytes = ug.padded * g.param_bytes;
    if (staged) comm_stream->wait(*s->copied);
    comm::Comm* c = &comm;
    comm_stream->enqueue([c, full, own, bytes, full_bytes] {
      c->all_gather_bytes({own, bytes}, {full, full_bytes});
    });
  }
}

template <typename Produce>
void ZeroEngine::Impl::publish(int unit, size_t slot, Produce&& produce) {
  bool staged = false;
  std::byte* out = publish_target(unit, slot, staged);
  produce(out);
  finish_publish(unit, slot, staged);
}

void ZeroEngine::Impl::initialise(uint64_t seed) {
  const model::ModelLayout& layout = model.layout();
  const DType dt = g.placement.param_dtype;
  float* master = scratch.as<float>().data();
  for (size_t u = 0; u < g.units.size(); ++u) {
    if (options.stop_requested != nullptr && options.stop_requested->load())
      throw Interrupted(
          fmt::format("interrupted while initialising the model ({} of {} units "
                      "done); nothing was trained",
                      u, g.units.size()));
    const detail::UnitGeometry& ug = g.units[u];
    const int unit = static_cast<int>(u);
    model::init_params(layout, unit, seed, ug.own_off, ug.own_off + ug.own_len, master);
    optimizer->init(unit, {master, ug.own_len});
    publish(unit, u % std::max<size_t>(1, publish_slots.size()),
            [&](std::byte* out) { to_param_dtype(master, out, dt, ug.own_len); });
    wait_publications();  // the next unit reuses `master`
  }
}

// ---- the optimizer step ---------------------------------------------------------------------

double ZeroEngine::Impl::gradient_sum_of_squares() {
  // Block partials of this rank's reduced partitions (taken per micro-batch already when the
  // gradients live on NVMe), gathered from every rank and added in slab order: unit by unit,
  // rank by rank, block by block, the order one rank holding every slab would use.
  if (g.placement.gradients != Tier::kNvme) {
    for (size_t u = 0; u < g.units.size(); ++u) {
      const detail::UnitGeometry& ug = g.units[u];
      const float* reduced = grad_accumulator(static_cast<int>(u)) + ug.red_off;
      cpu_adam::block_sums_of_squares(reduced, DType::F32, ug.part, detail::kNormBlock,
                                      norm_blocks.data() + norm_block_off[u], &executor);
    }
  }
  const size_t n = norm_blocks.size();
  const size_t w = static_cast<size_t>(g.world);
  std::vector<double> all(w * n);
  comm.all_gather_bytes(std::as_bytes(std::span<const double>(norm_blocks)),
                        std::as_writable_bytes(std::span<double>(all)));
  double total = 0.0;
  for (size_t u = 0; u < g.units.size(); ++u) {
    const size_t first = norm_block_off[u];
    const size_t len = g.units[u].part / detail::kNormBlock;
    for (size_t r = 0; r < w; ++r)
      for (size_t b = 0; b < len; ++b) total += all[r * n + first + b];
  }
  return total;
}

namespace {

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

}  // namespace

StepResult ZeroEngine::Impl::step(const StepParams& sp) {
  join_step();
  if (!accumulating)
    throw InvalidArgument(
        "zero: step: no gradients since the last step (call forward_backward first)");
  if (!(sp.loss_scale > 0) || !std::isfinite(sp.loss_scale))
    throw InvalidArgument(
        fmt::format("zero: step: loss_scale must be positive, got {}", sp.loss_scale));
  drain_grads(0);
  grad->synchronize();
  comm_stream->synchronize();
  accumulating = false;
  const int stage = g.placement.stage;
  const size_t U = g.units.size();
  // The pass's tentative step stays open (undone by the next call) until judged below, so an
  // error before the verdict cannot leave the worker waiting for one.
  std::shared_ptr<StepRun::Tentative> tentative;
  {
    std::lock_guard lock(step_run.m);
    tentative = step_run.open;
    step_run.expected.reset();
  }

  // Stage 0 keeps full gradients on every rank: gather the partitions reduced per micro-batch.
  for (size_t u = 0; u < U && stage == 0 && g.world > 1; ++u) {
    float* acc = grad_accumulator(static_cast<int>(u));
    const detail::UnitGeometry& ug = g.units[u];
    comm.all_gather(std::span<const float>(acc + ug.red_off, ug.part), {acc, ug.padded});
  }
  const double total = gradient_sum_of_squares();

  StepResult r;
  cpu_adam::AdamParams hp;
  const bool overflow = !std::isfinite(total) && sp.check_overflow;
  if (overflow) {
    r.overflow = true;
    r.grad_norm = total;
  } else {
    // The trainer's loss scale already averages over ranks (scale / (gas * world)).
    r.grad_norm = std::sqrt(total) / sp.loss_scale;
    r.grad_scale = unscale_and_clip_multiplier(r.grad_norm, sp.loss_scale, sp.gradient_clipping);
    hp = adam_params(sp, r.grad_scale);
    cpu_adam::validate(hp);
    step_run.last_unclipped = r.grad_scale == unscale_and_clip_multiplier(0.0, sp.loss_scale, 0.0);
  }

  if (tentative) {
    // The units stepped during the backward used the multiplier without clipping: they stand
    // if the step's parameters are exactly those, else every unit is stepped again from the
    // state kept (or, on overflow, its parameters are rounded again from it).
    if (coordinator) coordinator->drop_all();
    std::unique_lock lock(step_run.m);
    StepRun::Tentative& t = *tentative;
    step_run.open.reset();  // judged here
    if (overflow) {
      t.verdict = StepRun::Verdict::kRestore;
      r.in_backward = StepResult::InBackward::kRestored;
    } else {
      t.verdict = hp == t.hp ? StepRun::Verdict::kCommit : StepRun::Verdict::kRedo;
      r.in_backward = t.verdict == StepRun::Verdict::kCommit ? StepResult::InBackward::kCommitted
                                                             : StepResult::InBackward::kRedone;
      t.final_hp = hp;
      step_run.done.assign(U, 0);
      step_run.active = true;
      step_run.error = nullptr;
      step_run.running = true;  // run_tentative finishes this step
    }
    step_run.cv.notify_all();
    if (overflow) {
      step_run.cv.wait(lock, [&] { return t.ended; });
      if (step_run.error) std::rethrow_exception(step_run.error);
    }
    return r;
  }
  if (overflow) return r;
  if (coordinator) coordinator->drop_all();
  {
    std::lock_guard lock(step_run.m);
    step_run.done.assign(U, 0);
    step_run.active = true;
    step_run.error = nullptr;
  }
  if (!options.overlap_step) {
    run_unit_steps(hp);
    join_step();
    return r;
  }
  if (!step_run.worker.joinable()) step_run.worker = std::thread([this] { step_worker(); });
  {
    std::lock_guard lock(step_run.m);
    step_run.job = hp;
    step_run.running = true;
  }
  step_run.cv.notify_all();
  return r;
}

void ZeroEngine::Impl::step_worker() {
  trace::name_thread("zero-step");
  std::unique_lock lock(step_run.m);
  for (;;) {
    step_run.cv.wait(lock, [&] {
      return step_run.quit || step_run.job.has_value() || !step_run.tentative_jobs.empty();
    });
    std::exception_ptr error;
    if (step_run.job) {
      const cpu_adam::AdamParams hp = *step_run.job;
      step_run.job.reset();
      lock.unlock();
      try {
        run_unit_steps(hp);
      } catch (...) {
        error = std::current_exception();
      }
      lock.lock();
      if (error) step_run.error = error;
      step_run.running = false;
      step_run.cv.notify_all();
      continue;
    }
    if (!step_run.tentative_jobs.empty()) {
      std::shared_ptr<StepRun::Tentative> t = std::move(step_run.tentative_jobs.front());
      step_run.tentative_jobs.pop_front();
      lock.unlock();
      try {
        run_tentative(*t);
      } catch (...) {
        error = std::current_exception();
      }
      lock.lock();
      if (error) step_run.error = error;
      t->ended = true;
      if (t->verdict == StepRun::Verdict::kCommit || t->verdict == StepRun::Verdict::kRedo)
        step_run.running = false;  // it was this step's run
      step_run.cv.notify_all();
      continue;
    }
    return;  // quit
  }
}

// ---- the step during backward ---------------------------------------------------------------

void ZeroEngine::Impl::expect_step(const StepParams& sp) {
  if (!g.step_in_backward || !options.overlap_step) return;
  const bool clipping = sp.gradient_clipping > 0;
  std::lock_guard lock(step_run.m);
  step_run.expected.reset();
  if (clipping && !step_run.last_unclipped) return;  // clipping is likely: step after backward
  step_run.expected = sp;
}

std::shared_ptr<ZeroEngine::Impl::StepRun::Tentative> ZeroEngine::Impl::arm_tentative() {
  cancel_tentative();  // a pass after an armed one: its tentative step cannot stand
  std::lock_guard lock(step_run.m);
  if (!step_run.expected) return nullptr;
  const StepParams sp = *step_run.expected;
  step_run.expected.reset();
  if (!(sp.loss_scale > 0) || !std::isfinite(sp.loss_scale)) return nullptr;
  auto t = std::make_shared<StepRun::Tentative>();
  t->hp = adam_params(sp, unscale_and_clip_multiplier(0.0, sp.loss_scale, 0.0));
  cpu_adam::validate(t->hp);
  if (!step_run.worker.joinable()) step_run.worker = std::thread([this] { step_worker(); });
  step_run.open = t;
  step_run.tentative_jobs.push_back(t);
  step_run.cv.notify_all();
  return t;
}

void ZeroEngine::Impl::cancel_tentative() {
  std::unique_lock lock(step_run.m);
  std::shared_ptr<StepRun::Tentative> t = std::move(step_run.open);
  step_run.open.reset();
  if (!t) return;
  t->verdict = StepRun::Verdict::kRestore;
  step_run.cv.notify_all();
  step_run.cv.wait(lock, [&] { return t->ended; });
}

void ZeroEngine::Impl::restore_params(int unit, size_t slot) {
  const detail::UnitGeometry& ug = g.units[unit];
  float* master = scratch.as<float>().data();
  optimizer->read(unit, StateKind::kMaster, {master, ug.own_len});
  const DType dt = g.placement.param_dtype;
  publish(unit, slot, [&](std::byte* out) { to_param_dtype(master, out, dt, ug.own_len); });
  wait_publications();  // the next unit reuses `master`
}

void ZeroEngine::Impl::run_tentative(StepRun::Tentative& t) {
  using Verdict = StepRun::Verdict;
  const cpu_adam::AdamParams& hp = t.hp;
  // Phase 1: units in the order their gradients become final, until the verdict.
  auto next = [&]() -> int {
    std::unique_lock lock(step_run.m);
    step_run.cv.wait(lock, [&] { return !t.posted.empty() || t.verdict != Verdict::kOpen; });
    if (t.verdict != Verdict::kOpen) return -1;  // the rest in unit order (or not at all)
    const int unit = t.posted.front();
    t.posted.pop_front();
    t.written.push_back(unit);
    return unit;
  };
  auto complete = [&](int unit, size_t slot) {
    if (detail::staged_publication(g.placement, static_cast<size_t>(unit))) wait_slot(slot);
    if (g.placement.stage == 1 || g.placement.stage == 2) comm_stream->synchronize();
    std::unique_lock lock(step_run.m);
    if (t.verdict == Verdict::kOpen) return t.finished.push_back(unit);
    const Verdict v = t.verdict;
    lock.unlock();
    if (v != Verdict::kCommit) return optimizer->discard(unit);
    optimizer->commit(unit);
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
    std::unique_lock lock(step_run.m);
    step_run.cv.wait(lock, [&] { return t.verdict != Verdict::kOpen; });
    v = t.verdict;
  }
  // Phase 2: the verdict. Every unit still pending is committed or discarded first, so a
  // failure leaves no tentative state behind.
  for (int unit : t.finished) {
    if (v == Verdict::kCommit) {
      optimizer->commit(unit);
      mark_done(unit);
    } else {
      optimizer->discard(unit);
    }
  }
  const std::vector<int> written = std::move(t.written);
  cpu_adam::AdamParams final_hp;
  {
    std::lock_guard lock(step_run.m);
    final_hp = t.final_hp;
  }
  if (error) std::rethrow_exception(error);
  if (v == Verdict::kRestore) {
    const size_t slots = std::max<size_t>(1, publish_slots.size());
    for (size_t k = 0; k < written.size(); ++k) restore_params(written[k], k % slots);
    return;
  }
  if (v == Verdict::kRedo) {
    std::lock_guard lock(step_run.m);
    step_run.done.assign(g.units.size(), 0);
  }
  run_unit_steps(final_hp);
}

void ZeroEngine::Impl::mark_done(int unit) {
  std::lock_guard lock(step_run.m);
  step_run.done.at(static_cast<size_t>(unit)) = 1;
  step_run.cv.notify_all();
}

bool ZeroEngine::Impl::unit_pending(int unit) {
  std::lock_guard lock(step_run.m);
  return step_run.active && !step_run.done[static_cast<size_t>(unit)] && step_run.error == nullptr;
}

void ZeroEngine::Impl::wait_unit(int unit) {
  std::unique_lock lock(step_run.m);
  if (!step_run.active) return;
  const size_t u = static_cast<size_t>(unit);
  step_run.cv.wait(lock, [&] { return step_run.done[u] || step_run.error != nullptr; });
  if (!step_run.done[u]) std::rethrow_exception(step_run.error);
}

void ZeroEngine::Impl::finish_step() {
  cancel_tentative();
  join_step();
}

void ZeroEngine::Impl::join_step() {
  std::unique_lock lock(step_run.m);
  step_run.cv.wait(lock, [&] { return !step_run.running; });
  if (!step_run.active) return;
  if (step_run.error) std::rethrow_exception(step_run.error);  // the engine is unusable now
  step_run.active = false;
}

void ZeroEngine::Impl::run_unit_steps(const cpu_adam::AdamParams& hp) {
  const size_t U = g.units.size();
  std::vector<char> done;
  {
    std::lock_guard lock(step_run.m);
    done = step_run.done;
  }
  size_t u = 0;
  auto next = [&]() -> int {
    while (u < U && done[u]) ++u;  // stepped during the backward
    return u < U ? static_cast<int>(u++) : -1;
  };
  // A unit is done when its new parameters are where the next pass reads them: the staging
  // slot's copy or swap write finished, and at stages 1-2 the gather of every rank's
  // partition into the full slab.
  auto complete = [&](int unit, size_t slot) {
    if (detail::staged_publication(g.placement, static_cast<size_t>(unit))) wait_slot(slot);
    if (g.placement.stage == 1 || g.placement.stage == 2) comm_stream->synchronize();
    mark_done(unit);
  };
  step_units(hp, next, /*tentative=*/false, complete);
  wait_publications();
  std::lock_guard lock(step_run.m);
  std::fill(step_run.done.begin(), step_run.done.end(), 1);
  step_run.cv.notify_all();
}

void ZeroEngine::Impl::step_units(const cpu_adam::AdamParams& hp, const std::function<int()>& next,
                                  bool tentative,
                                  const std::function<void(int, size_t)>& complete) {
  const DType dt = g.placement.param_dtype;
  const size_t slots = std::max<size_t>(1, publish_slots.size());
  const size_t concurrent = optimizer->concurrent_steps();
  // Gradient slots: slot 0 accumulates; a tentative step runs beside that pass.
  const size_t grad_slots = grad_buffers.size();
  auto grad_slot = [&](size_t k) {
    return tentative && grad_slots > 1 ? 1 + k % (grad_slots - 1) : k;
  };
  auto run_one = [this, &hp, dt, tentative](int unit, size_t gslot, void* out) {
    const float* grads = load_grads(unit, gslot);
    if (tentative)
      optimizer->step_tentative(unit, grads, hp, out, dt);
    else
      optimizer->step(unit, grads, hp, out, dt);
  };
  if (concurrent <= 1) {
    for (size_t k = 0;; ++k) {
      const int unit = next();
      if (unit < 0) break;
      publish(unit, k % slots, [&](std::byte* out) { run_one(unit, grad_slot(k), out); });
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
    finish_publish(f.unit, f.slot, f.staged);
    complete(f.unit, f.slot);
  };
  try {
    for (size_t k = 0;; ++k) {
      if (running.size() >= concurrent) finish_front();
      const int unit = next();
      if (unit < 0) break;
      Running rn{unit, k % slots, false, {}};
      std::byte* out = publish_target(unit, rn.slot, rn.staged);
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

// ---- state access ---------------------------------------------------------------------------

void ZeroEngine::Impl::get_master_weights(int unit, std::span<float> out) {
  check_unit(unit);
  const detail::UnitGeometry& ug = g.units[unit];
  if (out.size() != ug.padded)
    throw InvalidArgument(
        fmt::format("zero: get_master_weights: unit {} has {} elements, got a "
                    "buffer of {}",
                    unit, ug.padded, out.size()));
  comm_stream->synchronize();
  std::span<float> own = out.subspan(ug.own_off, ug.own_len);
  optimizer->read(unit, StateKind::kMaster, own);
  if (g.placement.stage != 0) comm.all_gather(own, out);
}

void ZeroEngine::Impl::copy_home_partition(int unit, std::span<std::byte> own) {
  const size_t part_bytes = own.size();
  switch (home->tier(unit)) {
    case Tier::kDevice:
      copy->copy_d2h(own.data(), home->resident(unit), part_bytes);
      copy->synchronize();
      traffic.d2h += part_bytes;
      break;
    case Tier::kPinned:
    case Tier::kHost:
      std::memcpy(own.data(), home->resident(unit), part_bytes);
      break;
    case Tier::kNvme: {
      PublishSlot& s = publish_slots.at(0);
      home->swapper()->wait(home->start_read(unit, s.buf.data()));
      std::memcpy(own.data(), s.buf.data(), part_bytes);
      break;
    }
  }
}

void ZeroEngine::Impl::get_params(int unit, std::span<std::byte> out) {
  check_unit(unit);
  const detail::UnitGeometry& ug = g.units[unit];
  const size_t full_bytes = ug.padded * g.param_bytes;
  if (out.size() != full_bytes)
    throw InvalidArgument(
        fmt::format("zero: get_params: unit {} has {} bytes of parameters, got "
                    "a buffer of {}",
                    unit, full_bytes, out.size()));
  wait_publications();
  if (g.placement.stage < 3) {
    copy->copy_d2h(out.data(), full_params[unit].data(), full_bytes);
    copy->synchronize();
    traffic.d2h += full_bytes;
    return;
  }
  const size_t part_bytes = ug.part * g.param_bytes;
  std::span<std::byte> own = out.subspan(static_cast<size_t>(g.rank) * part_bytes, part_bytes);
  copy_home_partition(unit, own);
  comm.all_gather_bytes(own, out);
}

void ZeroEngine::Impl::read_state(int unit, StateKind kind, std::span<float> out) {
  check_unit(unit);
  optimizer->read(unit, kind, out);
}

void ZeroEngine::Impl::write_state(int unit, StateKind kind, std::span<const float> in) {
  check_unit(unit);
  optimizer->write(unit, kind, in);
  if (kind != StateKind::kMaster) return;
  if (coordinator) coordinator->drop_all();
  const DType dt = g.placement.param_dtype;
  publish(unit, 0, [&](std::byte* out) { to_param_dtype(in.data(), out, dt, in.size()); });
  wait_publications();
}

void ZeroEngine::Impl::visit_unit_state(int unit, const StateVisitor& fn) {
  check_unit(unit);
  optimizer->visit(unit, fn);
}

void ZeroEngine::Impl::fill_unit_state(int unit, const StateFiller& fn) {
  check_unit(unit);
  if (coordinator) coordinator->drop_all();
  const DType dt = g.placement.param_dtype;
  publish(unit, 0, [&](std::byte* out) {
    optimizer->fill(unit, [&](uint64_t first, uint64_t n, float* master, float* m, float* v) {
      fn(first, n, master, m, v);
      to_param_dtype(master, out + first * g.param_bytes, dt, n);
    });
  });
  wait_publications();
}

void ZeroEngine::Impl::visit_param_partition(
    int unit, const std::function<void(std::span<const std::byte>)>& fn) {
  check_unit(unit);
  const detail::UnitGeometry& ug = g.units[unit];
  const size_t own_bytes = ug.own_len * g.param_bytes;
  wait_publications();
  const std::byte* src = nullptr;  // device memory holding the partition
  if (g.placement.stage < 3) {
    src = full_params[unit].as<std::byte>() + ug.own_off * g.param_bytes;
  } else if (home->tier(unit) == Tier::kDevice) {
    src = home->resident(unit);
  } else if (home->tier(unit) != Tier::kNvme) {
    return fn({home->resident(unit), own_bytes});  // pinned or host memory
  } else {
    PublishSlot& s = publish_slots.at(0);
    home->swapper()->wait(home->start_read(unit, s.buf.data()));
    return fn({s.buf.data(), own_bytes});
  }
  if (device.host_accessible()) return fn({src, own_bytes});
  AlignedBuffer host(own_bytes);
  copy->copy_d2h(host.data(), src, own_bytes);
  copy->synchronize();
  traffic.d2h += own_bytes;
  fn({host.data(), own_bytes});
}

}  // namespace outcore::zero
