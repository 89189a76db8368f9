// ZeroEngine: construction (plan, tiers, swap files, the parts of engine_impl.hpp), a
// micro-batch, and the public calls.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <thread>

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
  if (ec == std::errc::not_a_directory || ec == std::errc::file_exists ||
      (!ec && !fs::is_directory(path, ec)))  // a file, a FIFO or a link to nowhere in its place
    throw ConfigError(key,
                      fmt::format("{}: is not a directory (a swap directory goes there)", path));
  if (ec) throw IoError(path, ec.value(), "create swap directory");
}

// What the engine may allocate on `device`, counting the `held` bytes the compute backend
// already holds there as free (the plan counts them, PlanOptions::compute_workspace_bytes): the
// budget left, capped by what the hardware still has free (a GPU); 0 = unlimited. `reserve`:
// what the gradient sums leave free there (device_reserve_bytes).
uint64_t device_limit(device::Device& device, uint64_t held, uint64_t* reserve = nullptr,
                      bool* by_hardware = nullptr) {
  const device::MemoryStats ms = device.memory_stats();
  const uint64_t in_use = ms.in_use_bytes - std::min(held, ms.in_use_bytes);
  uint64_t limit = 0;
  if (ms.budget_bytes > 0) limit = ms.budget_bytes > in_use ? ms.budget_bytes - in_use : 1;
  uint64_t free = device.free_memory_bytes();
  if (free > 0) free += held;
  if (reserve != nullptr) *reserve = device_reserve_bytes(limit, free);
  if (by_hardware != nullptr) *by_hardware = free > 0 && (limit == 0 || free < limit);
  if (free > 0) limit = limit == 0 ? free : std::min(limit, free);
  return limit;
}

// The bytes the model's compute backend holds on `device` now (0 when it computes elsewhere).
uint64_t backend_held(const device::Device& device, const model::LlamaModel& model) {
  return model.backend().device() == &device ? model.backend().device_bytes() : 0;
}

PlanOptions engine_plan_options(device::Device& device, const model::LlamaModel& model, int world,
                                GradientPlacement gradients,
                                std::optional<uint64_t> save_piece_elems) {
  PlanOptions po{.world_size = world,
                 .gradients = gradients,
                 .device_host_accessible = device.host_accessible(),
                 .device_in_host_memory = device.kind() == device::DeviceKind::Cpu,
                 .save_piece_elems = save_piece_elems};
  if (model.backend().device() == &device)  // a backend on another device charges that one
    po.compute_workspace_bytes = model.backend().workspace_bytes(model.workspace_shape());
  po.device_limit_bytes =
      device_limit(device, backend_held(device, model), &po.device_reserve_bytes);
  return po;
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
      g(detail::make_geometry(cfg, model,
                              {.world = comm.world_size(),
                               .rank = comm.rank(),
                               .warn = true,
                               .gradients = options.gradients,
                               .device_host_accessible = device.host_accessible()})),
      // The geometry's gradient placement, so that kAuto is resolved once.
      plan(make_plan(
          cfg, model,
          engine_plan_options(device, model, comm.world_size(),
                              g.placement.gradients == Tier::kNvme ? GradientPlacement::kNvme
                                                                   : GradientPlacement::kHost,
                              options.save_piece_elems))),
      executor(options.cpu_threads != 0 ? options.cpu_threads : cpu_threads_for(cfg)),
      data_executor(options.cpu_threads != 0 ? options.cpu_threads : data_path_threads()) {
  PlanLimits limits = options.check_system_limits ? system_limits(cfg, plan) : PlanLimits{};
  limits_at_start = limits;
  bool by_gpu = false;
  limits.device = device_limit(device, backend_held(device, model), nullptr, &by_gpu);
  if (by_gpu) limits.device_by = "the free memory of " + device.name();
  check_fits(plan, limits);
  const Placement& p = g.placement;
  const config::ZeroConfig& z = cfg.zero_optimization;
  const detail::PinnedLayout pl = detail::effective_pinned_layout(cfg, g, plan.device_grad_sums);
  if (const detail::PinnedLayout full =
          detail::pinned_layout(cfg, g, plan.device_grad_sums, detail::PinnedLayoutSize::kFull);
      pl.total() < full.total()) {
    // The parts that have any buffers in this placement.
    std::vector<std::string> parts;
    if (full.fetch_slots > 0)
      parts.push_back(fmt::format("{} of {} parameter fetch buffers (offload_param.buffer_count)",
                                  pl.fetch_slots, full.fetch_slots));
    if (full.concurrent_steps > 0)
      parts.push_back(fmt::format("{} of {} optimizer unit step{} at once", pl.concurrent_steps,
                                  full.concurrent_steps, full.concurrent_steps == 1 ? "" : "s"));
    log::warn(
        "outcore.pinned_memory_mb {} holds {:.1f} of the {:.1f} MiB of pinned buffers this "
        "placement uses at full speed{}{}; raise it for deeper prefetch",
        cfg.outcore.pinned_memory_mb, pl.total() / 1048576.0, full.total() / 1048576.0,
        parts.empty() ? "" : ": ", fmt::join(parts, ", "));
  } else if (full.total() == 0 && cfg.outcore.pinned_memory_mb != 0)
    log::warn(
        "outcore.pinned_memory_mb {} has no effect: this placement uses no pinned buffers "
        "(nothing offloaded to host memory or NVMe, no gradient copies from a GPU, no "
        "collectives on the host)",
        cfg.outcore.pinned_memory_mb);

  copy = device.create_stream("zero-copy");
  comm_stream = device.create_stream("zero-comm");
  comm_lane = std::make_unique<detail::HostLane>("zero-collectives");
  grad_d2h = device.create_stream("zero-grad-d2h");
  device::Device* dev = &device;  // the pool's region is registered for the device's copies
  pool = std::make_unique<swap::PinnedPool>(swap::PinnedPoolOptions{
      .budget_bytes = plan.pinned_pool_bytes,
      .lock = detail::pool_page_locked(z),
      .hook = {
          .on_register = [dev](std::span<std::byte> r) { dev->register_host(r.data(), r.size()); },
          .on_unregister = [dev](std::span<std::byte> r) { dev->unregister_host(r.data()); }}});

  if (p.nvme_param_units > 0 || p.optimizer == Tier::kNvme)
    aio = std::make_unique<aio::Engine>(aio_options(cfg.aio), options.io_backend);
  const swap::SwapperOptions so{.verify_checksums = cfg.outcore.swap_checksum};
  if (p.nvme_param_units > 0) {  // only the units max_in_cpu leaves out of host memory
    make_swap_dir(plan.param_nvme_path, "zero_optimization.offload_param.nvme_path");
    param_space = std::make_unique<swap::SwapSpace>(
        swap::SwapSpaceOptions{
            .nvme_path = plan.param_nvme_path, .rank = g.rank, .world_size = g.world},
        detail::param_swap_files(g));
    param_swapper = std::make_unique<swap::Swapper>(*param_space, *aio, so, &data_executor);
  }
  if (p.optimizer == Tier::kNvme) {
    if (g.rank == 0 && !plan.sub_group_padding.empty()) log::warn("{}", plan.sub_group_padding);
    make_swap_dir(plan.optimizer_nvme_path, "zero_optimization.offload_optimizer.nvme_path");
    optimizer_space = std::make_unique<swap::SwapSpace>(
        swap::SwapSpaceOptions{
            .nvme_path = plan.optimizer_nvme_path, .rank = g.rank, .world_size = g.world},
        detail::optimizer_swap_files(g));
    optimizer_swapper = std::make_unique<swap::Swapper>(*optimizer_space, *aio, so, &executor);
  }
  grads = std::make_unique<detail::GradientPath>(
      g, device, model.backend(), comm, *comm_lane, *grad_d2h, data_executor, traffic, *pool,
      aio.get(), so, plan.optimizer_nvme_path, pl, plan.device_grad_sums,
      plan.micro_batches_per_step);
  // Several ranks on a device the host cannot read: parameters are gathered here (fetches
  // and publications, one at a time on the comm lane), then copied up whole.
  swap::PinnedBuffer param_gather;
  if (pl.param_gather_bytes > 0) param_gather = pool->acquire(pl.param_gather_bytes);

  auto acts = std::make_unique<model::ActivationBuffers>(
      model, device, cfg.activation_checkpointing.cpu_checkpointing);
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
    fetch_lane = std::make_unique<detail::HostLane>("zero-fetch-wait");
    coordinator = std::make_unique<detail::ParamCoordinator>(
        g, *home, device, *fetch_stream, *comm_stream, *comm_lane, *fetch_lane, comm,
        std::move(fetch_buffers), traffic, std::move(co));
    coordinator->set_step_gate([this](int unit) { return steps->pending(unit); },
                               [this](int unit) { steps->wait_unit(unit); });
    if (param_gather.valid()) coordinator->set_gather_buffer(param_gather.data());
    coordinator->set_compute_stream(model.backend().stream());
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
                                        &device, executor, traffic, plan.device_grad_sums);
  } else {
    optimizer = detail::make_memory_store(g, &device, executor, traffic, plan.device_grad_sums);
  }
  publisher = std::make_unique<detail::ParamPublisher>(
      g, device, comm, *copy, *comm_stream, *comm_lane, full_params, home.get(), traffic, *pool,
      pl.writeback_slots, pl.writeback_slot_bytes, std::move(param_gather));
  scratch = AlignedBuffer(g.max_own_len * sizeof(float));
  steps = std::make_unique<detail::StepScheduler>(g, options.overlap_step, *optimizer, *grads,
                                                  *publisher, scratch.as<float>());
  passes = std::make_unique<detail::PassDriver>(model, std::move(acts), full_params,
                                                coordinator.get(), *grads, *steps);
  initialise(seed);
}

ZeroEngine::Impl::~Impl() {
  // Compute still queued after a failed pass may use the buffers the parts below free.
  if (device::Stream* compute = model.backend().stream(); compute != nullptr) {
    try {
      compute->synchronize();
    } catch (const std::exception& e) {
      log::warn("zero: shutting down after a failed computation: {}", e.what());
    }
  }
  grads->quiesce();  // its last tasks may post units to the step scheduler
  try {
    steps->finish();
  } catch (const std::exception& e) {
    log::warn("zero: shutting down after a failed optimizer step: {}", e.what());
  }
  if (fetch_lane != nullptr) {
    try {
      fetch_lane->wait();  // its tasks wait on the step scheduler and queue fetch copies
    } catch (const std::exception& e) {
      log::warn("zero: shutting down after a failed parameter fetch: {}", e.what());
    }
  }
  steps->stop();  // idle now: finish() waited for it
  try {
    comm_lane->wait();  // its tasks use the parts below
  } catch (const std::exception& e) {
    log::warn("zero: shutting down after a failed collective: {}", e.what());
  }
  for (device::Stream* s : {fetch_stream.get(), copy.get(), grad_d2h.get(), comm_stream.get()}) {
    if (s == nullptr) continue;
    try {
      s->synchronize();
    } catch (const std::exception& e) {
      log::warn("zero: shutting down after an error on stream {}: {}", s->name(), e.what());
    }
  }
  // ~ParamPublisher then waits for the publications' swap writes.
}

float ZeroEngine::Impl::forward_backward(const int32_t* tokens, const int32_t* targets,
                                         float loss_scale, bool first) {
  if (!first && !accumulating)
    throw InvalidArgument(
        "zero: forward_backward: first_micro_batch must be true for the first micro-batch after "
        "construction or step()");
  if (tokens == nullptr || targets == nullptr)
    throw InvalidArgument("zero: forward_backward: tokens and targets are required");
  const float loss = passes->train(tokens, targets, loss_scale, first);
  accumulating = true;
  return loss;
}

float ZeroEngine::Impl::evaluate(const int32_t* tokens, const int32_t* targets) {
  if (tokens == nullptr || targets == nullptr)
    throw InvalidArgument("zero: evaluate: tokens and targets are required");
  return passes->evaluate(tokens, targets);
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
unsigned ZeroEngine::cpu_threads() const { return impl_->executor.threads(); }
unsigned ZeroEngine::data_threads() const { return impl_->data_executor.threads(); }

unsigned cpu_threads_for(const config::Config& cfg) {
  return cpu_threads_for(cfg.zero_optimization.offload_optimizer.cpuadam_cores_perc,
                         std::max(1u, std::thread::hardware_concurrency()));
}

unsigned cpu_threads_for(double share, unsigned hardware_threads) {
  if (!(share > 0 && share <= 1))
    throw InvalidArgument(fmt::format("cpuadam_cores_perc {} is not in (0, 1]", share));
  const double n = std::round(share * static_cast<double>(hardware_threads));
  return std::clamp(static_cast<unsigned>(n), 1u, cpu_adam::Executor::kMaxThreads);
}

unsigned data_path_threads() {
  return std::clamp(std::thread::hardware_concurrency(), 1u, cpu_adam::Executor::kMaxThreads);
}

float ZeroEngine::forward_backward(const int32_t* tokens, const int32_t* targets, float loss_scale,
                                   bool first_micro_batch) {
  return impl_->forward_backward(tokens, targets, loss_scale, first_micro_batch);
}

float ZeroEngine::evaluate(const int32_t* tokens, const int32_t* targets) {
  return impl_->evaluate(tokens, targets);
}

StepResult ZeroEngine::step(const StepParams& params) { return impl_->step(params); }
void ZeroEngine::expect_step(const StepParams& params) { impl_->steps->expect(params); }
void ZeroEngine::wait_step() { impl_->steps->finish(); }

void ZeroEngine::get_master_weights(int unit, std::span<float> out) {
  impl_->steps->finish();
  impl_->get_master_weights(unit, out);
}
void ZeroEngine::get_params(int unit, std::span<std::byte> out) {
  impl_->steps->finish();
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
  impl_->steps->finish();
  impl_->visit_unit_state(unit, fn);
}
void ZeroEngine::fill_unit_state(int unit, const StateFiller& fn) {
  impl_->steps->finish();
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
  impl_->steps->finish();
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
  impl_->steps->finish();
  impl_->read_state(unit, kind, out);
}
void ZeroEngine::write_state(int unit, StateKind kind, std::span<const float> in) {
  impl_->steps->finish();
  impl_->write_state(unit, kind, in);
}

TrafficStats ZeroEngine::traffic() const {
  TrafficStats t;
  const std::initializer_list<const swap::Swapper*> swappers = {
      impl_->param_swapper.get(), impl_->optimizer_swapper.get(), impl_->grads->swapper()};
  for (const swap::Swapper* s : swappers) {
    if (s == nullptr) continue;
    const swap::SwapperStats ss = s->stats();
    t.nvme_read_bytes += ss.drive_bytes_in;
    t.nvme_write_bytes += ss.drive_bytes_out;
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
