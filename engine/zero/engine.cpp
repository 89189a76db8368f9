// ZeroEngine: construction (plan, tiers, swap files) and the forward/backward passes.
#include <fmt/format.h>

#include <cstring>
#include <filesystem>

#include "common/error.hpp"
#include "common/log.hpp"
#include "common/trace.hpp"
#include "engine/zero/engine_impl.hpp"

namespace outcore::zero {
namespace {

namespace fs = std::filesystem;

void make_swap_dir(const std::string& path, const char* key) {
  if (path.empty()) throw ConfigError(key, "nvme offload needs a swap directory (nvme_path)");
  std::error_code ec;
  fs::create_directories(path, ec);
  if (ec) throw IoError(path, ec.value(), "create swap directory");
}

// What the engine may allocate on `device`: the budget left, capped by what the hardware
// still has free (a GPU); 0 = unlimited.
uint64_t device_limit(device::Device& device) {
  const device::MemoryStats ms = device.memory_stats();
  uint64_t limit = 0;
  if (ms.budget_bytes > 0)
    limit = ms.budget_bytes > ms.in_use_bytes ? ms.budget_bytes - ms.in_use_bytes : 1;
  if (const uint64_t free = device.free_memory_bytes(); free > 0)
    limit = limit == 0 ? free : std::min(limit, free);
  return limit;
}

// acc = g (first micro-batch) or acc + g, element by element: the one accumulation every
// configuration performs, so results do not depend on where the accumulator lives.
void accumulate(float* acc, const float* g, size_t n, bool first) {
  if (first) {
    std::memcpy(acc, g, n * sizeof(float));
    return;
  }
  for (size_t i = 0; i < n; ++i) acc[i] += g[i];
}

// The gradient reduction of one micro-batch: `shards` holds every rank's contribution to
// this rank's partition (n elements each, rank 0 first, as all_to_all leaves them), added
// into acc one rank after the other. With micro-batch m of a step on rank m % world, this is
// the same sequence of fp32 additions, in the same order, as one rank accumulating the
// world's micro-batches one by one: the reason world W x gas G trains bit-identically to
// world 1 x gas W*G.
void accumulate_ranks(float* acc, const float* shards, size_t n, int world, bool first) {
  for (int r = 0; r < world; ++r)
    accumulate(acc, shards + static_cast<size_t>(r) * n, n, first && r == 0);
}

// What a device the host cannot read (a GPU) supports: the model computes there and every
// transfer is a stream copy (several ranks: their collectives run on host memory, through
// pinned copy-back and gather buffers), but CPU Adam needs the optimizer state in host memory
// or swap files.
void check_discrete_device(const detail::Geometry& g, const device::Device& device) {
  for (size_t u = 0; u < g.units.size(); ++u)
    if (g.placement.optimizer_home(u) == Tier::kDevice)
      throw ConfigError(
          "zero_optimization.offload_optimizer",
          fmt::format(
              "the optimizer state of unit {} would live on {}, but the optimizer is CPU "
              "Adam; use offload_optimizer.device cpu or nvme with ratio 1{}",
              u, device.name(),
              g.placement.stage == 0 ? " and ZeRO stage 1 or higher (stage 0 ignores it)" : ""));
}

}  // namespace

aio::Options aio_options(const config::AioConfig& a) {
  aio::Options o;
  o.block_size = static_cast<size_t>(a.block_size);
  o.queue_depth = static_cast<unsigned>(a.queue_depth);
  o.thread_count = static_cast<unsigned>(a.intra_op_parallelism);
  o.single_submit = a.single_submit;
  o.overlap_events = a.overlap_events;
  return o;
}

ZeroEngine::Impl::Impl(const config::Config& cfg_in, const model::LlamaModel& model_in,
                       device::Device& device_in, comm::Comm& comm_in, uint64_t seed,
                       EngineOptions options_in)
    : cfg(cfg_in),
      model(model_in),
      device(device_in),
      comm(comm_in),
      options(std::move(options_in)),
      g(detail::make_geometry(cfg, model, comm.world_size(), comm.rank(), true, options.gradients,
                              device.host_accessible())),
      plan(make_plan(cfg, model,
                     {.world_size = comm.world_size(),
                      .device_limit_bytes = device_limit(device),
                      // the geometry's decision, so that kAuto is resolved once
                      .gradients = g.placement.gradients == Tier::kNvme ? GradientPlacement::kNvme
                                                                        : GradientPlacement::kHost,
                      .device_host_accessible = device.host_accessible()})),
      executor(options.cpu_threads),
      train_sched(detail::train_schedule(model)),
      eval_sched(detail::eval_schedule(model)) {
  if (!device.host_accessible()) check_discrete_device(g, device);
  PlanLimits limits = options.check_system_limits ? system_limits(cfg, plan) : PlanLimits{};
  limits_at_start = limits;
  limits.device = device_limit(device);
  check_fits(plan, limits);
  const Placement& p = g.placement;
  const config::ZeroConfig& z = cfg.zero_optimization;
  const detail::PinnedLayout pl = detail::effective_pinned_layout(cfg, g);

  copy = device.create_stream("zero-copy");
  grad = device.create_stream("zero-grad");
  comm_stream = device.create_stream("zero-comm");
  comm_done = device.create_event();
  device::Device* dev = &device;  // the pool's region is registered for the device's copies
  pool = std::make_unique<swap::PinnedPool>(swap::PinnedPoolOptions{
      .budget_bytes = plan.pinned_pool_bytes,
      .lock = z.offload_param.pin_memory && z.offload_optimizer.pin_memory,
      .hook = {
          .on_register = [dev](std::span<std::byte> r) { dev->register_host(r.data(), r.size()); },
          .on_unregister = [dev](std::span<std::byte> r) { dev->unregister_host(r.data()); }}});

  if (p.nvme_param_units > 0 || p.optimizer == Tier::kNvme)
    aio = std::make_unique<aio::Engine>(aio_options(cfg.aio), options.io_backend);
  const swap::SwapperOptions so{.verify_checksums = cfg.outcore.swap_checksum};
  if (p.nvme_param_units > 0) {  // only the units max_in_cpu leaves out of host memory
    make_swap_dir(plan.param_nvme_path, "zero_optimization.offload_param.nvme_path");
    param_space = std::make_unique<swap::SwapSpace>(
        swap::SwapSpaceOptions{.nvme_path = plan.param_nvme_path, .rank = g.rank},
        detail::param_swap_files(g));
    param_swapper = std::make_unique<swap::Swapper>(*param_space, *aio, so, &executor);
  }
  if (p.optimizer == Tier::kNvme) {
    make_swap_dir(plan.optimizer_nvme_path, "zero_optimization.offload_optimizer.nvme_path");
    optimizer_space = std::make_unique<swap::SwapSpace>(
        swap::SwapSpaceOptions{.nvme_path = plan.optimizer_nvme_path, .rank = g.rank},
        detail::optimizer_swap_files(g));
    optimizer_swapper = std::make_unique<swap::Swapper>(*optimizer_space, *aio, so, &executor);
  }
  if (p.gradients == Tier::kNvme) {
    grad_space = std::make_unique<swap::SwapSpace>(
        swap::SwapSpaceOptions{.nvme_path = plan.optimizer_nvme_path, .rank = g.rank},
        detail::grad_swap_files(g));
    grad_swapper = std::make_unique<swap::Swapper>(*grad_space, *aio, so, &executor);
    for (size_t u = 0; u < g.units.size(); ++u)
      grad_ids.push_back(grad_space->find(static_cast<uint32_t>(u), swap::SwapKind::kGrad, "g"));
    for (size_t k = 0; k < pl.grad_slots; ++k)
      grad_buffers.push_back(pool->acquire(pl.grad_slot_bytes));
  }
  if (pl.grad_copy_back_bytes > 0) grad_copy_back = pool->acquire(pl.grad_copy_back_bytes);
  if (pl.param_gather_bytes > 0) param_gather = pool->acquire(pl.param_gather_bytes);
  for (const detail::UnitGeometry& ug : g.units) {
    norm_block_off.push_back(norm_blocks.size());
    norm_blocks.resize(norm_blocks.size() + ug.part / detail::kNormBlock);
  }

  acts = std::make_unique<model::ActivationBuffers>(model, device,
                                                    cfg.activation_checkpointing.cpu_checkpointing);
  if (p.stage < 3) {
    for (size_t u = 0; u < g.units.size(); ++u)
      full_params.push_back(
          device.alloc(g.units[u].padded * g.param_bytes, fmt::format("parameters of unit {}", u)));
  } else {
    home = std::make_unique<detail::ParamHome>(g, device, pool.get(), param_swapper.get());
    std::vector<swap::PinnedBuffer> fetch_buffers;
    for (size_t k = 0; k < pl.fetch_slots; ++k)
      fetch_buffers.push_back(pool->acquire(pl.fetch_slot_bytes));
    detail::CoordinatorOptions co =
        detail::coordinator_options(cfg, g, plan.device_live_param_bytes);
    // Fetches have a stream of their own: a fetch waiting there for the optimizer step must not
    // hold up the step's publications, which use the copy stream.
    fetch_stream = device.create_stream("zero-fetch");
    coordinator = std::make_unique<detail::ParamCoordinator>(
        g, *home, device, *fetch_stream, *comm_stream, comm, std::move(fetch_buffers), traffic,
        std::move(co));
    coordinator->set_step_gate([this](int unit) { return unit_pending(unit); },
                               [this](int unit) { wait_unit(unit); });
    if (param_gather.valid()) coordinator->set_gather_buffer(param_gather.data());
  }
  for (size_t u = 0; u < g.units.size(); ++u) {
    const size_t bytes = g.units[u].accum_len * sizeof(float);
    if (p.gradients == Tier::kDevice)
      device_accum.push_back(
          device.alloc(bytes, fmt::format("gradient accumulator of unit {}", u)));
    else if (p.gradients == Tier::kHost)
      host_accum.emplace_back(bytes);
  }
  if (p.optimizer == Tier::kNvme) {
    swap::OptimizerSwapperOptions oo;
    oo.sub_group_size = g.sub_group_size;
    oo.buffer_count = pl.optimizer_buffer_count;
    oo.moments = g.moments;
    oo.pipeline_read = z.offload_optimizer.pipeline_read;
    oo.pipeline_write = z.offload_optimizer.pipeline_write;
    oo.spare_copy = g.step_in_backward;
    optimizer = detail::make_nvme_store(g, *optimizer_swapper, *pool, oo, pl.concurrent_steps,
                                        &device, executor);
  } else {
    optimizer = detail::make_memory_store(g, &device, executor);
  }
  for (size_t k = 0; k < pl.writeback_slots; ++k)
    publish_slots.push_back(
        {pool->acquire(pl.writeback_slot_bytes), device.create_event(), false, {}});
  scratch = AlignedBuffer(g.max_own_len * sizeof(float));
  initialise(seed);
}

ZeroEngine::Impl::~Impl() {
  try {
    finish_step();
  } catch (const std::exception& e) {
    log::warn("zero: shutting down after a failed optimizer step: {}", e.what());
  }
  if (step_run.worker.joinable()) {  // idle now: finish_step waited for it
    {
      std::lock_guard lock(step_run.m);
      step_run.quit = true;
    }
    step_run.cv.notify_all();
    step_run.worker.join();
  }
  for (device::Stream* s : {fetch_stream.get(), copy.get(), grad.get(), comm_stream.get()}) {
    if (s == nullptr) continue;
    try {
      s->synchronize();
    } catch (const std::exception& e) {
      log::warn("zero: shutting down after an error on stream {}: {}", s->name(), e.what());
    }
  }
  for (PublishSlot& s : publish_slots) {
    if (!s.write.valid()) continue;
    try {
      home->swapper()->wait(s.write);
    } catch (const std::exception& e) {
      log::warn("zero: shutting down: {}", e.what());
    }
  }
}

const void* ZeroEngine::Impl::params_of(int unit) const {
  return coordinator ? coordinator->slab(unit) : full_params[unit].data();
}

float* ZeroEngine::Impl::grad_accumulator(int unit) {
  return device_accum.empty() ? host_accum[unit].as<float>().data()
                              : device_accum[unit].as<float>();
}

void ZeroEngine::Impl::drain_grads(size_t keep) {
  while (in_flight.size() > keep) {
    in_flight.front().done->synchronize();
    in_flight.pop_front();
  }
}

device::DeviceBuffer ZeroEngine::Impl::alloc_grad_slab(int unit) {
  drain_grads(detail::kGradSlabsInFlight);
  return device.alloc(g.units[unit].padded * sizeof(float),
                      fmt::format("gradient slab of unit {}", unit));
}

// Hands a unit's freshly computed gradient slab to the gradient path: every rank's part of it
// sent to the rank that owns that partition (all_to_all in place, comm stream, world > 1),
// then the world's contributions added rank by rank into this rank's reduced partition of
// the accumulator (grad stream), device-to-host when the accumulator lives in host memory.
// Below stage 2 the accumulator is the full slab and only the partition at red_off is
// accumulated; step() gathers the rest (stage 0) or needs only that (stage 1). On a device the
// host cannot read, the slab is first copied back to pinned memory (grad stream), and the
// all_to_all runs there.
void ZeroEngine::Impl::post_when_final(int unit) {
  if (!pass_tentative || !optimizer->can_step_tentatively(unit)) return;
  // The pass is the step's last: once the grad stream gets here the unit's gradients are
  // final, and the step worker may start its Adam.
  std::shared_ptr<StepRun::Tentative> t = pass_tentative;
  StepRun* run = &step_run;
  grad->enqueue([run, t, unit] {
    {
      std::lock_guard lock(run->m);
      t->posted.push_back(unit);
    }
    run->cv.notify_all();
  });
}

void ZeroEngine::Impl::submit_grads(int unit, device::DeviceBuffer slab, bool first) {
  const detail::UnitGeometry& ug = g.units[unit];
  InFlightGrad f{std::move(slab), device.create_event(), device.create_event(),
                 device.create_event()};
  float* shards = f.slab.as<float>();
  const int world = g.world;
  if (!g.device_host_accessible) {
    // The grad stream handles one slab at a time (its next copy-back is queued after this
    // slab's accumulation), so one copy-back buffer serves every unit.
    float* host = grad_copy_back.as<float>().data();
    grad->copy_d2h(host, shards, ug.padded * sizeof(float));
    shards = host;
    if (world > 1) {
      grad->record(*f.copied);
      comm_stream->wait(*f.copied);
    }
  }
  if (world > 1) {
    comm::Comm* c = &comm;
    const size_t padded = ug.padded;
    comm_stream->enqueue([c, shards, padded] { c->all_to_all({shards, padded}); });
    comm_stream->record(*f.reduced);
    grad->wait(*f.reduced);
  }
  const size_t n = ug.part;
  if (g.placement.gradients == Tier::kNvme) {
    // The partition's sum so far lives in a swap file: read it (later micro-batches), add,
    // take its block sums of squares (the step's norm uses the last micro-batch's), write it
    // back. One staging buffer: the grad stream handles one unit at a time.
    traffic.d2h += static_cast<uint64_t>(world) * n * sizeof(float);
    const std::span<std::byte> staging{grad_buffers[0].data(), n * sizeof(float)};
    float* acc = reinterpret_cast<float*>(staging.data());
    swap::Swapper* sw = grad_swapper.get();
    const swap::TensorId id = grad_ids[unit];
    double* blocks = norm_blocks.data() + norm_block_off[unit];
    const cpu_adam::Executor* ex = &executor;
    grad->enqueue([sw, id, staging, acc, shards, n, world, first] {
      OUTCORE_TRACE_SPAN("grad d2h", "copy", {.bytes = int64_t(world * n * sizeof(float))});
      if (!first) sw->read(id, staging);
      accumulate_ranks(acc, shards, n, world, first);
    });
    grad->enqueue([sw, id, staging, acc, n, blocks, ex] {
      cpu_adam::block_sums_of_squares(acc, DType::F32, n, detail::kNormBlock, blocks, ex);
      sw->write(id, staging);
    });
    post_when_final(unit);
    grad->record(*f.done);
    in_flight.push_back(std::move(f));
    return;
  }
  float* acc = grad_accumulator(unit) + ug.red_off;
  if (device_accum.empty()) traffic.d2h += static_cast<uint64_t>(world) * n * sizeof(float);
  grad->enqueue([acc, shards, n, world, first] {
    OUTCORE_TRACE_SPAN("grad d2h", "copy", {.bytes = int64_t(world * n * sizeof(float))});
    accumulate_ranks(acc, shards, n, world, first);
  });
  post_when_final(unit);
  grad->record(*f.done);
  in_flight.push_back(std::move(f));
}

float ZeroEngine::Impl::forward_backward(const int32_t* tokens, const int32_t* targets,
                                         float loss_scale, bool first) {
  if (!first && !accumulating)
    throw InvalidArgument(
        "zero: forward_backward: first_micro_batch must be true for the first micro-batch after "
        "construction or step()");
  if (tokens == nullptr || targets == nullptr)
    throw InvalidArgument("zero: forward_backward: tokens and targets are required");
  const int head = model.num_units() - 1;
  const bool tied = model.config().tie_word_embeddings;
  model::ActivationBuffers& a = *acts;
  pass_tentative = arm_tentative();
  if (coordinator) coordinator->begin(&train_sched);
  float loss = 0.0f;
  for (size_t i = 0; i < train_sched.size(); ++i) {
    const detail::PassStep& s = train_sched[i];
    const int u = s.unit;
    wait_unit(u);  // a step still publishing later units runs on
    for (int v : s.needs) wait_unit(v);
    if (coordinator) coordinator->acquire(i);
    if (!s.backward) {
      if (u == 0)
        model.forward(0, {.params = params_of(0), .tokens = tokens, .output = a.unit_input(1)});
      else
        model.forward(u, {.params = params_of(u),
                          .input = a.unit_input(u),
                          .output = a.unit_input(u + 1),
                          .saved = a.saved(u),
                          .scratch = a.scratch()});
      if (u != head) a.after_forward(u);  // staged cpu_checkpointing: output down to the host
    } else if (u == head) {
      a.before_backward(head);
      if (tied) tied_slab = alloc_grad_slab(0);
      device::DeviceBuffer gs = alloc_grad_slab(head);
      loss = model.backward(head, {.params = params_of(head),
                                   .tied_params = tied ? params_of(0) : nullptr,
                                   .targets = targets,
                                   .input = a.unit_input(head),
                                   .grad_input = a.grad(),
                                   .grads = gs.as<float>(),
                                   .tied_grads = tied ? tied_slab.as<float>() : nullptr,
                                   .mode = model::GradMode::Overwrite,
                                   .loss_scale = loss_scale,
                                   .scratch = a.scratch()});
      submit_grads(head, std::move(gs), first);
    } else if (u > 0) {
      a.before_backward(u);
      device::DeviceBuffer gs = alloc_grad_slab(u);
      model.backward(u, {.params = params_of(u),
                         .input = a.unit_input(u),
                         .grad_output = a.grad(),
                         .grad_input = a.grad(),
                         .grads = gs.as<float>(),
                         .mode = model::GradMode::Overwrite,
                         .saved = a.saved(u),
                         .scratch = a.scratch()});
      submit_grads(u, std::move(gs), first);
    } else {
      device::DeviceBuffer gs = tied ? std::move(tied_slab) : alloc_grad_slab(0);
      model.backward(0, {.tokens = tokens,
                         .grad_output = a.grad(),
                         .grads = gs.as<float>(),
                         .mode = model::GradMode::Overwrite});
      submit_grads(0, std::move(gs), first);
    }
    if (coordinator) coordinator->release(i);
  }
  drain_grads(0);
  pass_tentative.reset();
  if (coordinator) coordinator->end();
  accumulating = true;
  return loss;
}

float ZeroEngine::Impl::evaluate(const int32_t* tokens, const int32_t* targets) {
  if (tokens == nullptr || targets == nullptr)
    throw InvalidArgument("zero: evaluate: tokens and targets are required");
  cancel_tentative();  // the parameters of a step step() has not judged are not the model's
  const int head = model.num_units() - 1;
  const bool tied = model.config().tie_word_embeddings;
  model::ActivationBuffers& a = *acts;
  if (coordinator) coordinator->begin(&eval_sched);
  float loss = 0.0f;
  for (size_t i = 0; i < eval_sched.size(); ++i) {
    const int u = eval_sched[i].unit;
    wait_unit(u);  // a step still publishing later units runs on
    for (int v : eval_sched[i].needs) wait_unit(v);
    if (coordinator) coordinator->acquire(i);
    if (u == 0)
      model.forward(0, {.params = params_of(0), .tokens = tokens, .output = a.unit_input(1)});
    else if (u < head)
      model.forward(u, {.params = params_of(u),
                        .input = a.unit_input(u),
                        .output = a.unit_input(u + 1),
                        .saved = a.saved(u),
                        .scratch = a.scratch()});
    else
      loss = model.forward(head, {.params = params_of(head),
                                  .tied_params = tied ? params_of(0) : nullptr,
                                  .targets = targets,
                                  .input = a.unit_input(head),
                                  .scratch = a.scratch()});
    if (coordinator) coordinator->release(i);
  }
  if (coordinator) coordinator->end();
  return loss;
}

// ---- ZeroEngine -----------------------------------------------------------------------------

ZeroEngine::ZeroEngine(const config::Config& cfg, const model::LlamaModel& model,
                       device::Device& device, comm::Comm& comm, uint64_t seed,
                       EngineOptions options)
    : impl_(std::make_unique<Impl>(cfg, model, device, comm, seed, std::move(options))) {}

ZeroEngine::~ZeroEngine() = default;

const PlanLimits& ZeroEngine::limits() const { return impl_->limits_at_start; }
const Plan& ZeroEngine::plan() const { return impl_->plan; }
const model::LlamaModel& ZeroEngine::model() const { return impl_->model; }

float ZeroEngine::forward_backward(const int32_t* tokens, const int32_t* targets, float loss_scale,
                                   bool first_micro_batch) {
  return impl_->forward_backward(tokens, targets, loss_scale, first_micro_batch);
}

float ZeroEngine::evaluate(const int32_t* tokens, const int32_t* targets) {
  return impl_->evaluate(tokens, targets);
}

StepResult ZeroEngine::step(const StepParams& params) { return impl_->step(params); }
void ZeroEngine::expect_step(const StepParams& params) { impl_->expect_step(params); }
void ZeroEngine::wait_step() { impl_->finish_step(); }

void ZeroEngine::get_master_weights(int unit, std::span<float> out) {
  impl_->finish_step();
  impl_->get_master_weights(unit, out);
}
void ZeroEngine::get_params(int unit, std::span<std::byte> out) {
  impl_->finish_step();
  impl_->get_params(unit, out);
}

size_t ZeroEngine::partition_numel(int unit) const {
  impl_->check_unit(unit);
  return impl_->g.units[unit].own_len;
}
size_t ZeroEngine::partition_offset(int unit) const {
  impl_->check_unit(unit);
  return impl_->g.units[unit].own_off;
}
void ZeroEngine::visit_unit_state(int unit, const StateVisitor& fn) {
  impl_->finish_step();
  impl_->visit_unit_state(unit, fn);
}
void ZeroEngine::fill_unit_state(int unit, const StateFiller& fn) {
  impl_->finish_step();
  impl_->fill_unit_state(unit, fn);
}
void ZeroEngine::read_unit_state(int unit, std::span<float> master, std::span<float> exp_avg,
                                 std::span<float> exp_avg_sq) {
  const size_t n = partition_numel(unit);
  if (master.size() != n || exp_avg.size() != n || exp_avg_sq.size() != n)
    throw InvalidArgument(
        fmt::format("zero: read_unit_state of unit {} needs 3 x {} elements", unit, n));
  visit_unit_state(unit,
                   [&](size_t first, size_t k, const float* m, const float* a, const float* v) {
                     std::memcpy(master.data() + first, m, k * sizeof(float));
                     std::memcpy(exp_avg.data() + first, a, k * sizeof(float));
                     std::memcpy(exp_avg_sq.data() + first, v, k * sizeof(float));
                   });
}
void ZeroEngine::write_unit_state(int unit, std::span<const float> master,
                                  std::span<const float> exp_avg,
                                  std::span<const float> exp_avg_sq) {
  const size_t n = partition_numel(unit);
  if (master.size() != n || exp_avg.size() != n || exp_avg_sq.size() != n)
    throw InvalidArgument(
        fmt::format("zero: write_unit_state of unit {} needs 3 x {} elements", unit, n));
  fill_unit_state(unit, [&](size_t first, size_t k, float* m, float* a, float* v) {
    std::memcpy(m, master.data() + first, k * sizeof(float));
    std::memcpy(a, exp_avg.data() + first, k * sizeof(float));
    std::memcpy(v, exp_avg_sq.data() + first, k * sizeof(float));
  });
}
void ZeroEngine::visit_param_partition(int unit,
                                       const std::function<void(std::span<const std::byte>)>& fn) {
  impl_->finish_step();
  impl_->visit_param_partition(unit, fn);
}
void ZeroEngine::read_param_partition(int unit, std::span<std::byte> out) {
  visit_param_partition(unit, [&](std::span<const std::byte> p) {
    if (out.size() != p.size())
      throw InvalidArgument(
          fmt::format("zero: read_param_partition: unit {} has {} bytes on this "
                      "rank, got a buffer of {}",
                      unit, p.size(), out.size()));
    std::memcpy(out.data(), p.data(), p.size());
  });
}
DType ZeroEngine::param_dtype() const { return impl_->g.placement.param_dtype; }
void ZeroEngine::read_state(int unit, StateKind kind, std::span<float> out) {
  impl_->finish_step();
  impl_->read_state(unit, kind, out);
}
void ZeroEngine::write_state(int unit, StateKind kind, std::span<const float> in) {
  impl_->finish_step();
  impl_->write_state(unit, kind, in);
}

TrafficStats ZeroEngine::traffic() const {
  TrafficStats t;
  for (const swap::Swapper* s :
       {impl_->param_swapper.get(), impl_->optimizer_swapper.get(), impl_->grad_swapper.get()}) {
    if (s == nullptr) continue;
    const swap::SwapperStats ss = s->stats();
    t.nvme_read_bytes += ss.bytes_in;
    t.nvme_write_bytes += ss.bytes_out;
  }
  t.h2d_bytes = impl_->traffic.h2d.load();
  t.d2h_bytes = impl_->traffic.d2h.load();
  return t;
}

MemoryPeaks ZeroEngine::memory() const {
  const device::MemoryStats ms = impl_->device.memory_stats();
  return {.device_peak_bytes = ms.peak_bytes,
          .device_budget_bytes = ms.budget_bytes,
          .pinned_peak_bytes = impl_->pool->peak_bytes(),
          .pinned_budget_bytes = impl_->pool->budget_bytes()};
}

}  // namespace outcore::zero
