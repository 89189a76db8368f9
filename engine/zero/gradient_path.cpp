// The gradient path: all_to_all per micro-batch, ordered accumulation, the step's norm.
#include "engine/zero/gradient_path.hpp"

#include <fmt/format.h>

#include <cstring>
#include <vector>

#include "common/error.hpp"
#include "common/log.hpp"
#include "common/trace.hpp"
#include "engine/device/device_adam.hpp"

namespace outcore::zero::detail {
namespace {

// Host accumulation runs on the executor's threads in chunks of this many elements, from
// this many on (a slab copied back from a GPU arrives faster than one core adds it).
constexpr size_t kAccumulateGrain = size_t{1} << 14;
constexpr size_t kAccumulateParallelMin = size_t{1} << 18;

// acc = g (first micro-batch) or acc + g, element by element: the one accumulation every
// configuration performs (the backend's add_inplace for device sums), so results do not
// depend on where the accumulator lives or how many threads add.
void accumulate(float* acc, const float* g, size_t n, bool first, const cpu_adam::Executor& ex) {
  ex.for_chunks(n, kAccumulateGrain, kAccumulateParallelMin,
                [acc, g, first](size_t /*chunk*/, size_t begin, size_t end) {
                  if (first) {
                    std::memcpy(acc + begin, g + begin, (end - begin) * sizeof(float));
                    return;
                  }
                  for (size_t i = begin; i < end; ++i) acc[i] += g[i];
                });
}

// The gradient reduction of one micro-batch: `shards` holds every rank's contribution to
// this rank's partition (n elements each, rank 0 first, as all_to_all leaves them), added
// into acc one rank after the other. With micro-batch m of a step on rank m % world, this is
// the same sequence of fp32 additions, in the same order, as one rank accumulating the
// world's micro-batches one by one: the reason world W x gas G trains bit-identically to
// world 1 x gas W*G.
void accumulate_ranks(float* acc, const float* shards, size_t n, int world, bool first,
                      const cpu_adam::Executor& ex) {
  for (int r = 0; r < world; ++r)
    accumulate(acc, shards + static_cast<size_t>(r) * n, n, first && r == 0, ex);
}

}  // namespace

GradientPath::GradientPath(const Geometry& g, device::Device& device,
                           device::ComputeBackend& backend, comm::Comm& comm, HostLane& comm_lane,
                           device::Stream& d2h, const cpu_adam::Executor& executor,
                           TrafficCounters& traffic, swap::PinnedPool& pool, aio::Engine* aio,
                           const swap::SwapperOptions& swapper_options,
                           const std::string& nvme_path, const PinnedLayout& layout,
                           std::vector<bool> device_sums, int64_t micro_batches)
    : g_(g),
      device_(device),
      comm_(comm),
      comm_lane_(comm_lane),
      executor_(executor),
      traffic_(traffic),
      d2h_(d2h),
      backend_(backend),
      summed_on_device_(std::move(device_sums)),
      sums_(g.units.size()),
      sum_step_(g.units.size(), 0),
      micro_batches_(micro_batches) {
  if (summed_on_device_.size() != g.units.size())
    throw InvalidArgument(fmt::format("zero: gradient path: {} device-sum entries for {} units",
                                      summed_on_device_.size(), g.units.size()));
  for (size_t u = 0; u < g.units.size(); ++u)
    stays_.push_back(grads_stay_on_device(g, summed_on_device_, u));
  if (g.placement.gradients == Tier::kNvme) {
    // A file for every unit whose gradients do not stay on the device (those that do have none).
    std::vector<swap::SwapFileSpec> files = grad_swap_files(g, summed_on_device_);
    if (!files.empty()) {
      grad_space_ = std::make_unique<swap::SwapSpace>(
          swap::SwapSpaceOptions{.nvme_path = nvme_path, .rank = g.rank, .world_size = g.world},
          files);
      grad_swapper_ =
          std::make_unique<swap::Swapper>(*grad_space_, *aio, swapper_options, &executor);
    }
    for (size_t u = 0; u < g.units.size(); ++u)
      grad_ids_.push_back(
          stays_[u] ? swap::TensorId{}
                    : grad_space_->find(static_cast<uint32_t>(u), swap::SwapKind::kGrad, "g"));
    for (size_t k = 0; k < layout.grad_slots; ++k)
      grad_buffers_.push_back(pool.acquire(layout.grad_slot_bytes));
  }
  for (size_t k = 0; k < layout.grad_copy_back_slots; ++k)
    copy_back_.push_back(pool.acquire(layout.grad_copy_back_bytes));
  copy_back_added_.assign(copy_back_.size(), 0);
  if (grads_come_down(g, summed_on_device_) && copy_back_.empty())
    throw InvalidArgument(
        "zero: gradient path: a device the host cannot read needs copy-back buffers");
  size_t device_blocks = 0;  // of the units whose gradients stay on the device
  for (size_t u = 0; u < g.units.size(); ++u) {
    const UnitGeometry& ug = g.units[u];
    norm_block_off_.push_back(norm_blocks_.size());
    norm_blocks_.resize(norm_blocks_.size() + ug.part / kNormBlock);
    device_norm_off_.push_back(device_blocks);
    if (stays_[u]) device_blocks += ug.part / kNormBlock;
  }
  if (device_blocks > 0)
    device_norm_blocks_ =
        device.alloc(device_blocks * sizeof(double), "the gradient norm's block sums");
  for (size_t u = 0; u < g.units.size(); ++u) {
    const size_t bytes = g.units[u].accum_len * sizeof(float);
    if (g.placement.gradients == Tier::kDevice)
      device_accum_.push_back(
          device.alloc(bytes, fmt::format("gradient accumulator of unit {}", u)));
    else if (g.placement.gradients == Tier::kHost)
      host_accum_.push_back(stays_[u] ? AlignedBuffer() : AlignedBuffer(bytes));
  }
  // Adam on a device the host cannot read brings these units' accumulators up every step: as
  // registered memory the copies run at the pinned rate (a GPU's copy from pageable memory is
  // staged through a buffer of the driver's).
  for (size_t u = 0; u < host_accum_.size(); ++u) {
    if (!stepped_on_device(g, u) || stays_[u]) continue;
    AlignedBuffer& b = host_accum_[u];
    try {
      device.register_host(b.data(), b.size());
    } catch (const Error& e) {  // slower copies, the same results
      log::warn("zero: gradient accumulators stay unregistered with {} ({}): copies up slower",
                device.name(), e.what());
      break;
    }
    registered_.emplace_back(b.data(), Unregister{&device});
  }
}

float* GradientPath::accumulator(int unit) {
  return device_accum_.empty() ? host_accum_[unit].as<float>().data()
                               : device_accum_[unit].as<float>();
}

float* GradientPath::partition(int unit) {
  float* acc = accumulator(unit);
  return g_.placement.stage <= 1 ? acc + g_.units[unit].own_off : acc;
}

void GradientPath::drain(size_t keep) {
  while (in_flight_.size() > keep) {
    InFlight& f = in_flight_.front();
    if (f.copied != nullptr)
      f.copied->synchronize();  // copied down, or added into a device sum
    else
      lane_.wait_for(f.added);  // the host reads the slab itself
    in_flight_.pop_front();
  }
}

void GradientPath::quiesce() noexcept {
  try {
    lane_.wait();
  } catch (const std::exception& e) {
    log::warn("zero: gradient work failed: {}", e.what());
  }
}

void GradientPath::begin_pass(bool first) {
  micro_batch_ = first ? 0 : micro_batch_ + 1;
  step_ += first ? 1 : 0;
}

std::shared_ptr<device::Event> GradientPath::computed() {
  device::Stream* compute = backend_.stream();
  if (compute == nullptr) return nullptr;  // the backend's operations have finished
  std::shared_ptr<device::Event> e = device_.create_event();
  compute->record(*e);
  return e;
}

void GradientPath::finish() {
  const std::shared_ptr<device::Event> done = computed();  // the sums' last additions
  for (size_t u = 0; u < sums_.size(); ++u)
    if (sums_[u] && !stays_[u]) send_down(static_cast<int>(u), std::move(sums_[u]), true, {}, done);
  drain(0);
  d2h_.synchronize();
  lane_.wait();
  comm_lane_.wait();
}

device::DeviceBuffer GradientPath::alloc_slab(int unit) {
  // The gradients a unit kept on the device for its last step are free now: the unit's new
  // parameters, which its forward waited for, came from that step (freed before the new slab,
  // as the plan counts them).
  if (stays_[unit] && sum_step_[unit] != step_) sums_[unit] = {};
  drain(kGradSlabsInFlight);
  return device_.alloc(g_.units[unit].padded * sizeof(float),
                       fmt::format("gradient slab of unit {}", unit));
}

// Below stage 2 the accumulator is the full slab and only the partition at red_off is
// accumulated; step() gathers the rest (stage 0) or needs only that (stage 1). On a device the
// host cannot read, the slab is first copied down to a copy-back buffer (d2h stream), and the
// all_to_all runs there.
void GradientPath::submit(int unit, device::DeviceBuffer slab, bool first,
                          std::function<void()> when_final) {
  // The slab's compute may still be queued: finished before the slab goes if this throws.
  const device::FinishOnUnwind finish_first(backend_);
  device::DeviceBuffer& sum = sums_[unit];
  if (stays_[unit] && when_final)
    throw InvalidArgument(fmt::format(
        "zero: unit {}'s gradients stay on the device and cannot be stepped during the backward",
        unit));
  if (stays_[unit] && !first && !sum)
    throw InvalidArgument(
        fmt::format("zero: unit {}'s gradients stay on the device, but this step has no first "
                    "micro-batch of them to add to",
                    unit));
  if (summed_on_device_[unit] && (first || sum)) {
    if (first) {
      sum = std::move(slab);  // a step's first gradients of the unit are its sum so far
      sum_step_[unit] = step_;
    } else {
      backend_.add_inplace(sum.as<float>(), slab.as<float>(),
                           static_cast<int64_t>(g_.units[unit].padded));
      // The slab is free once the addition has run: in flight until then, as a copy would be.
      InFlight f;
      f.slab = std::move(slab);
      f.copied = computed();
      if (f.copied != nullptr) in_flight_.push_back(std::move(f));
    }
    // Kept for Adam on the device; else sent down after the step's last micro-batch, or now
    // for an armed pass, whose units step as soon as their gradients are final.
    if (stays_[unit] || (micro_batch_ + 1 < micro_batches_ && !when_final)) return;
    slab = std::move(sum);
    first = true;  // nothing of this step reached the accumulator yet: it becomes the sum
  }
  send_down(unit, std::move(slab), first, std::move(when_final), computed());
}

void GradientPath::send_down(int unit, device::DeviceBuffer slab, bool first,
                             std::function<void()> when_final,
                             const std::shared_ptr<device::Event>& computed) {
  const UnitGeometry& ug = g_.units[unit];
  InFlight f;
  // What follows can throw (bad_alloc) while the slab's compute, or its copy down, is queued.
  const device::FinishOnUnwind finish_first(backend_, &d2h_);
  f.slab = std::move(slab);
  float* shards = f.slab.as<float>();
  const int world = g_.world;
  // Held by the lanes' tasks too: the flight may end (drain) before they have run.
  std::shared_ptr<device::Event> copied;  // the copy down (a device the host cannot read)
  size_t copy_back = SIZE_MAX;
  if (!g_.device_host_accessible) {
    const size_t k = copy_back = next_copy_back_;
    next_copy_back_ = (k + 1) % copy_back_.size();
    float* host = copy_back_[k].as<float>().data();
    lane_.wait_for(copy_back_added_[k]);            // the host has added what the buffer held
    if (computed != nullptr) d2h_.wait(*computed);  // the slab's compute, queued before this
    d2h_.copy_d2h(host, shards, ug.padded * sizeof(float));
    copied = f.copied = device_.create_event();
    d2h_.record(*copied);
    shards = host;
  } else if (computed != nullptr) {
    computed->synchronize();  // the host reads the slab itself
  }
  uint64_t reduced = 0;  // the comm lane's all_to_all (world > 1)
  if (world > 1) {
    comm::Comm* c = &comm_;
    const size_t padded = ug.padded;
    reduced = comm_lane_.post([c, copied, shards, padded] {
      if (copied != nullptr) copied->synchronize();
      c->all_to_all({shards, padded});
    });
  }
  // The lane's tasks for this slab start once its bytes are in host memory and reduced.
  if (copied != nullptr || reduced != 0) {
    HostLane* comm_lane = &comm_lane_;
    lane_.post([copied, reduced, comm_lane] {
      if (copied != nullptr) copied->synchronize();
      if (reduced != 0) comm_lane->wait_for(reduced);
    });
  }
  const size_t n = ug.part;
  if (g_.placement.gradients == Tier::kNvme) {
    // The partition's sum so far lives in a swap file: read it (later micro-batches), add,
    // take its block sums of squares (the step's norm uses the last micro-batch's), write it
    // back. One staging buffer: the lane handles one unit at a time.
    traffic_.d2h += static_cast<uint64_t>(world) * n * sizeof(float);
    const std::span<std::byte> staging{grad_buffers_[0].data(), n * sizeof(float)};
    float* acc = reinterpret_cast<float*>(staging.data());
    swap::Swapper* sw = grad_swapper_.get();
    const swap::TensorId id = grad_ids_[unit];
    double* blocks = norm_blocks_.data() + norm_block_off_[unit];
    const cpu_adam::Executor* ex = &executor_;
    lane_.post([sw, id, staging, acc, shards, n, world, first, ex] {
      OUTCORE_TRACE_SPAN("grad d2h", "copy", {.bytes = int64_t(world * n * sizeof(float))});
      if (!first) sw->read(id, staging);
      accumulate_ranks(acc, shards, n, world, first, *ex);
    });
    f.added = lane_.post([sw, id, staging, acc, n, blocks, ex] {
      cpu_adam::block_sums_of_squares(acc, DType::F32, n, kNormBlock, blocks, ex);
      sw->write(id, staging);
    });
  } else {
    float* acc = accumulator(unit) + ug.red_off;
    if (device_accum_.empty()) traffic_.d2h += static_cast<uint64_t>(world) * n * sizeof(float);
    const cpu_adam::Executor* ex = &executor_;
    f.added = lane_.post([acc, shards, n, world, first, ex] {
      OUTCORE_TRACE_SPAN("grad d2h", "copy", {.bytes = int64_t(world * n * sizeof(float))});
      accumulate_ranks(acc, shards, n, world, first, *ex);
    });
  }
  if (copy_back != SIZE_MAX) copy_back_added_[copy_back] = f.added;
  if (when_final) lane_.post(std::move(when_final));
  in_flight_.push_back(std::move(f));
}

void GradientPath::gather_full_slabs() {
  if (g_.placement.stage != 0 || g_.world <= 1) return;
  for (size_t u = 0; u < g_.units.size(); ++u) {
    float* acc = accumulator(static_cast<int>(u));
    const UnitGeometry& ug = g_.units[u];
    comm_.all_gather(std::span<const float>(acc + ug.red_off, ug.part), {acc, ug.padded});
  }
}

void GradientPath::device_norm_blocks() {
  if (!device_norm_blocks_) return;
  // After the sums' last additions, on the copy-back stream: the block sums into device memory,
  // then down into the units' norm blocks (the same bits as the host's, device_adam.hpp).
  if (const std::shared_ptr<device::Event> done = computed(); done != nullptr) d2h_.wait(*done);
  auto* blocks = device_norm_blocks_.as<double>();
  for (size_t u = 0; u < g_.units.size(); ++u) {
    if (!stays_[u]) continue;
    if (!sums_[u] || sum_step_[u] != step_)
      throw InvalidArgument(
          fmt::format("zero: no gradients of unit {} this step to take the norm of", u));
    const UnitGeometry& ug = g_.units[u];
    device::queue_block_sums_of_squares(device_, d2h_, sums_[u].as<float>() + ug.red_off, ug.part,
                                        kNormBlock, blocks + device_norm_off_[u], &executor_);
  }
  // One copy of them all, then each unit's into its place among the norm blocks.
  std::vector<double>& down = device_norm_down_;
  down.resize(device_norm_blocks_.size() / sizeof(double));
  d2h_.copy_d2h(down.data(), blocks, down.size() * sizeof(double));
  d2h_.synchronize();
  traffic_.d2h += down.size() * sizeof(double);
  for (size_t u = 0; u < g_.units.size(); ++u)
    if (stays_[u])
      std::memcpy(norm_blocks_.data() + norm_block_off_[u], down.data() + device_norm_off_[u],
                  g_.units[u].part / kNormBlock * sizeof(double));
}

double GradientPath::sum_of_squares() {
  // Block partials of this rank's reduced partitions (taken per micro-batch already when the
  // gradients live on NVMe, on the device for those that stay there), gathered from every rank
  // and added in slab order: unit by unit, rank by rank, block by block, the order one rank
  // holding every slab would use.
  device_norm_blocks();
  if (g_.placement.gradients != Tier::kNvme) {
    for (size_t u = 0; u < g_.units.size(); ++u) {
      if (stays_[u]) continue;
      const UnitGeometry& ug = g_.units[u];
      const float* reduced = accumulator(static_cast<int>(u)) + ug.red_off;
      cpu_adam::block_sums_of_squares(reduced, DType::F32, ug.part, kNormBlock,
                                      norm_blocks_.data() + norm_block_off_[u], &executor_);
    }
  }
  const size_t n = norm_blocks_.size();
  const size_t w = static_cast<size_t>(g_.world);
  std::vector<double> all(w * n);
  comm_.all_gather_bytes(std::as_bytes(std::span<const double>(norm_blocks_)),
                         std::as_writable_bytes(std::span<double>(all)));
  double total = 0.0;
  for (size_t u = 0; u < g_.units.size(); ++u) {
    const size_t first = norm_block_off_[u];
    const size_t len = g_.units[u].part / kNormBlock;
    for (size_t r = 0; r < w; ++r)
      for (size_t b = 0; b < len; ++b) total += all[r * n + first + b];
  }
  return total;
}

const float* GradientPath::load(int unit, size_t slot) {
  if (stays_[unit]) {
    // The step runs under the next pass (decision 001), whose backward frees the sum only after
    // the unit's step has run (alloc_slab).
    if (!sums_[unit])
      throw InvalidArgument(fmt::format("zero: no gradients of unit {} to step", unit));
    return sums_[unit].as<float>() + (g_.placement.stage <= 1 ? g_.units[unit].own_off : 0);
  }
  if (g_.placement.gradients != Tier::kNvme) return partition(unit);
  swap::PinnedBuffer& b = grad_buffers_.at(slot % grad_buffers_.size());
  grad_swapper_->read(grad_ids_[unit], {b.data(), g_.units[unit].accum_len * sizeof(float)});
  return b.as<float>().data();
}

}  // namespace outcore::zero::detail
