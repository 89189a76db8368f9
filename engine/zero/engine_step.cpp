// ZeroEngine: the optimizer step (norm, overflow, multiplier, the verdict on a tentative step,
// then the per-unit work handed to the StepScheduler) and access to the training state.
#include <fmt/format.h>

#include <cmath>
#include <cstring>

#include "common/error.hpp"
#include "common/trace.hpp"
#include "engine/zero/engine_impl.hpp"

namespace outcore::zero {

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

// Elements per chunk of the initialisation's random weights (a Box-Muller pair costs tens of
// nanoseconds: 16K elements are well above a task's cost).
constexpr size_t kInitGrain = size_t{1} << 14;

void ZeroEngine::Impl::initialise(uint64_t seed) {
  const model::ModelLayout& layout = model.layout();
  const DType dt = g.placement.param_dtype;
  float* master = scratch.as<float>().data();
  if (coordinator) coordinator->drop_all();  // slabs kept from earlier passes hold the old values
  for (size_t u = 0; u < g.units.size(); ++u) {
    if (options.stop_requested != nullptr && options.stop_requested->load())
      throw Interrupted(
          fmt::format("interrupted while initialising the model ({} of {} units "
                      "done); nothing was trained",
                      u, g.units.size()));
    const detail::UnitGeometry& ug = g.units[u];
    const int unit = static_cast<int>(u);
    // On the executor's threads in chunks: a value depends only on (seed, tensor, index), so
    // the weights are the same bits for any split.
    executor.for_chunks(ug.own_len, kInitGrain, 2 * kInitGrain, [&](size_t, size_t b, size_t e) {
      model::init_params(layout, unit, seed, ug.own_off + b, ug.own_off + e, master + b);
    });
    optimizer->init(unit, {master, ug.own_len});  // its last writes go on under the next unit
    // publish() has converted `master` into its slot when it returns, so the next unit may
    // reuse `master` while this unit's parameters are still being written.
    publisher->publish(unit, u % publisher->slot_count(), [&](std::byte* out) {
      detail::to_param_dtype(master, out, dt, ug.own_len);
    });
    if (options.on_init_unit) options.on_init_unit(u + 1, g.units.size());
  }
  publisher->wait_all();
  optimizer->flush();
}

// ---- the optimizer step ---------------------------------------------------------------------

StepResult ZeroEngine::Impl::step(const StepParams& sp) {
  steps->join();
  if (!accumulating)
    throw InvalidArgument(
        "zero: step: no gradients since the last step (call forward_backward first)");
  if (!(sp.loss_scale > 0) || !std::isfinite(sp.loss_scale))
    throw InvalidArgument(
        fmt::format("zero: step: loss_scale must be positive, got {}", sp.loss_scale));
  grads->finish();
  accumulating = false;
  // The pass's tentative step stays open (undone by the next call) until judged below, so an
  // error before the verdict cannot leave the worker waiting for one.
  const std::shared_ptr<detail::TentativeStep> tentative = steps->open_tentative();

  // Stage 0 keeps full gradients on every rank: gather the partitions reduced per micro-batch.
  grads->gather_full_slabs();
  const double total = grads->sum_of_squares();

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
    hp = detail::adam_params(sp, r.grad_scale);
    cpu_adam::validate(hp);
    steps->note_multiplier(r.grad_scale == unscale_and_clip_multiplier(0.0, sp.loss_scale, 0.0));
  }
  if (overflow && !tentative) return r;      // nothing changes
  if (coordinator) coordinator->drop_all();  // fetched parameters are about to change
  if (tentative)
    r.in_backward = steps->judge(*tentative, overflow ? nullptr : &hp);
  else
    steps->start(hp);
  return r;
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
  comm_lane->wait();  // the collectives issued so far, before this one
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
      std::byte* staging = publisher->staging();
      home->swapper()->wait(home->start_read(unit, staging));
      std::memcpy(own.data(), staging, part_bytes);
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
  publisher->wait_all();
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
  publisher->publish(
      unit, 0, [&](std::byte* out) { detail::to_param_dtype(in.data(), out, dt, in.size()); });
  publisher->wait_all();
}

void ZeroEngine::Impl::visit_unit_state(int unit, const StateVisitor& fn) {
  check_unit(unit);
  optimizer->visit(unit, fn);
}

void ZeroEngine::Impl::fill_unit_state(int unit, const StateFiller& fn) {
  check_unit(unit);
  if (coordinator) coordinator->drop_all();
  const DType dt = g.placement.param_dtype;
  publisher->publish(unit, 0, [&](std::byte* out) {
    optimizer->fill(unit, [&](uint64_t first, uint64_t n, float* master, float* m, float* v) {
      fn(first, n, master, m, v);
      detail::to_param_dtype(master, out + first * g.param_bytes, dt, n);
    });
  });
  publisher->wait_all();
}

void ZeroEngine::Impl::visit_param_partition(
    int unit, const std::function<void(std::span<const std::byte>)>& fn) {
  check_unit(unit);
  const detail::UnitGeometry& ug = g.units[unit];
  const size_t own_bytes = ug.own_len * g.param_bytes;
  publisher->wait_all();
  const std::byte* src = nullptr;  // device memory holding the partition
  if (g.placement.stage < 3) {
    src = full_params[unit].as<std::byte>() + ug.own_off * g.param_bytes;
  } else if (home->tier(unit) == Tier::kDevice) {
    src = home->resident(unit);
  } else if (home->tier(unit) != Tier::kNvme) {
    return fn({home->resident(unit), own_bytes});  // pinned or host memory
  } else {
    std::byte* staging = publisher->staging();
    home->swapper()->wait(home->start_read(unit, staging));
    return fn({staging, own_bytes});
  }
  if (device.host_accessible()) return fn({src, own_bytes});
  AlignedBuffer host(own_bytes);
  copy->copy_d2h(host.data(), src, own_bytes);
  copy->synchronize();
  traffic.d2h += own_bytes;
  fn({host.data(), own_bytes});
}

}  // namespace outcore::zero
