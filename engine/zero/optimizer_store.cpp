#include "engine/zero/optimizer_store.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <vector>

#include "common/aligned_buffer.hpp"
#include "common/error.hpp"
#include "common/trace.hpp"
#include "engine/device/device_adam.hpp"

namespace outcore::zero::detail {
namespace {

void check_len(const char* what, int unit, size_t have, size_t want) {
  if (have != want)
    throw InvalidArgument(fmt::format("zero: {} of unit {}: got {} elements, the partition has {}",
                                      what, unit, have, want));
}

// Moments between fp32 arrays and their storage: copied (fp32), or narrowed to nearest even /
// widened exactly (bf16).
void store_moments(std::byte* dst, const float* src, size_t n, DType t) {
  if (t == DType::F32) return void(std::memcpy(dst, src, n * sizeof(float)));
  auto* h = reinterpret_cast<uint16_t*>(dst);
  for (size_t i = 0; i < n; ++i) h[i] = fp32_to_bf16(src[i]);
}

void load_moments(float* dst, const std::byte* src, size_t n, DType t) {
  if (t == DType::F32) return void(std::memcpy(dst, src, n * sizeof(float)));
  const auto* h = reinterpret_cast<const uint16_t*>(src);
  for (size_t i = 0; i < n; ++i) dst[i] = bf16_to_fp32(h[i]);
}

// The units whose optimizer home (Placement::optimizer_home) is the device or host memory;
// units homed on NVMe have no arrays here. A unit's arrays are [fp32 master | exp_avg |
// exp_avg_sq] with moments of g.moments.
class MemoryOptimizerStore final : public OptimizerStore {
 public:
  MemoryOptimizerStore(const Geometry& g, device::Device* device, const cpu_adam::Executor& ex,
                       TrafficCounters& traffic, std::vector<bool> device_sums)
      : g_(g),
        ex_(ex),
        traffic_(traffic),
        device_(device),
        device_sums_(std::move(device_sums)),
        base_(g.units.size(), nullptr) {
    bool on_device = false;
    for (size_t u = 0; u < g.units.size(); ++u) {
      if (g.placement.optimizer_home(u) == Tier::kDevice && device == nullptr)
        throw InvalidArgument(fmt::format(
            "zero: the optimizer state of unit {} lives on the device but no device was given", u));
      on_device = on_device || stepped_on_device(g, u);
    }
    if (on_device) {
      // Adam on the device (device_adam.hpp); gradients that do not stay on the device come up
      // into dev_grads_, new parameters bound for host memory go down from dev_out_.
      const DeviceAdamScratch scratch = device_adam_scratch(g, device_sums_);
      stream_ = device->create_stream("zero-optimizer");
      if (scratch.grad_bytes > 0)
        dev_grads_ = device->alloc(scratch.grad_bytes, "gradients of a unit stepped on the device");
      if (scratch.out_bytes > 0)
        dev_out_ =
            device->alloc(scratch.out_bytes, "new parameters of a unit stepped on the device");
    }
    for (size_t u = 0; u < g.units.size(); ++u) {
      const size_t bytes = g.units[u].own_len * g.optimizer_elem_bytes();
      switch (g.placement.optimizer_home(u)) {
        case Tier::kDevice:
          dev_.push_back(device->alloc(bytes, fmt::format("optimizer state of unit {}", u)));
          base_[u] = static_cast<std::byte*>(dev_.back().data());
          if (stream_)
            stream_->memset(base_[u], 0, bytes);
          else
            std::memset(base_[u], 0, bytes);
          break;
        case Tier::kNvme:
          break;
        default:
          host_.emplace_back(bytes);  // zeroed
          base_[u] = host_.back().data();
          break;
      }
    }
    if (stream_) stream_->synchronize();
  }

  void init(int unit, std::span<const float> master) override {
    check_len("initial master weights", unit, master.size(), n(unit));
    if (streamed(unit)) {
      stream_->copy_h2d(part(unit, StateKind::kMaster), master.data(), master.size_bytes());
      stream_->memset(part(unit, StateKind::kExpAvg), 0, 2 * moment_bytes(unit));
      stream_->synchronize();
      traffic_.h2d += master.size_bytes();
      return;
    }
    std::memcpy(part(unit, StateKind::kMaster), master.data(), master.size_bytes());
    std::memset(part(unit, StateKind::kExpAvg), 0, 2 * moment_bytes(unit));
  }

  void step(int unit, const float* grads, const cpu_adam::AdamParams& hp, void* out,
            DType out_dtype) override {
    if (streamed(unit)) return step_on_device(unit, grads, hp, out, out_dtype);
    OUTCORE_TRACE_SPAN("adam", "optimizer", {.unit = unit, .lanes = "optimizer"});
    auto* p = reinterpret_cast<float*>(part(unit, StateKind::kMaster));
    cpu_adam::ParamsOut po;
    if (out != nullptr && out_dtype != DType::F32) po = {out, out_dtype};
    const cpu_adam::Moments moments{part(unit, StateKind::kExpAvg),
                                    part(unit, StateKind::kExpAvgSq), g_.moments};
    cpu_adam::adam_step(hp, n(unit), p, {grads, DType::F32}, moments, po, &ex_);
    if (out != nullptr && out_dtype == DType::F32) std::memcpy(out, p, n(unit) * sizeof(float));
  }

  void read(int unit, StateKind kind, std::span<float> out) override {
    check_len("state read", unit, out.size(), n(unit));
    if (streamed(unit)) {
      std::vector<std::byte> raw(range_bytes(unit));
      for (size_t first = 0; first < n(unit); first += kWidenChunk)
        down_range(unit, kind, first, std::min(kWidenChunk, n(unit) - first), out.data() + first,
                   raw.data());
      return;
    }
    if (kind == StateKind::kMaster)
      return void(std::memcpy(out.data(), part(unit, kind), out.size_bytes()));
    load_moments(out.data(), part(unit, kind), out.size(), g_.moments);
  }

  void write(int unit, StateKind kind, std::span<const float> in) override {
    check_len("state write", unit, in.size(), n(unit));
    if (streamed(unit)) {
      std::vector<std::byte> raw(range_bytes(unit));
      for (size_t first = 0; first < n(unit); first += kWidenChunk)
        up_range(unit, kind, first, std::min(kWidenChunk, n(unit) - first), in.data() + first,
                 raw.data());
      return;
    }
    if (kind == StateKind::kMaster)
      return void(std::memcpy(part(unit, kind), in.data(), in.size_bytes()));
    store_moments(part(unit, kind), in.data(), in.size(), g_.moments);
  }

  // fp32 moments: one call over the whole arrays. bf16: ranges of kWidenChunk elements with the
  // moments widened into (visit) or narrowed from (fill) fp32 scratch.
  void visit(int unit, const swap::OptimizerSwapper::StateVisitor& fn) override {
    if (streamed(unit)) return visit_on_device(unit, fn);
    float* master = reinterpret_cast<float*>(part(unit, StateKind::kMaster));
    if (g_.moments == DType::F32) {
      return fn(0, n(unit), master, reinterpret_cast<float*>(part(unit, StateKind::kExpAvg)),
                reinterpret_cast<float*>(part(unit, StateKind::kExpAvgSq)));
    }
    const size_t mb = dtype_size(g_.moments);
    std::vector<float> m(std::min(n(unit), kWidenChunk)), v(m.size());
    for (size_t first = 0; first < n(unit); first += kWidenChunk) {
      const size_t len = std::min(kWidenChunk, n(unit) - first);
      load_moments(m.data(), part(unit, StateKind::kExpAvg) + first * mb, len, g_.moments);
      load_moments(v.data(), part(unit, StateKind::kExpAvgSq) + first * mb, len, g_.moments);
      fn(first, len, master + first, m.data(), v.data());
    }
  }

  void fill(int unit, const swap::OptimizerSwapper::StateFiller& fn) override {
    if (streamed(unit)) return fill_on_device(unit, fn);
    std::memset(part(unit, StateKind::kExpAvg), 0, 2 * moment_bytes(unit));
    float* master = reinterpret_cast<float*>(part(unit, StateKind::kMaster));
    if (g_.moments == DType::F32) {
      return fn(0, n(unit), master, reinterpret_cast<float*>(part(unit, StateKind::kExpAvg)),
                reinterpret_cast<float*>(part(unit, StateKind::kExpAvgSq)));
    }
    const size_t mb = dtype_size(g_.moments);
    std::vector<float> m(std::min(n(unit), kWidenChunk)), v(m.size());
    for (size_t first = 0; first < n(unit); first += kWidenChunk) {
      const size_t len = std::min(kWidenChunk, n(unit) - first);
      std::fill_n(m.data(), len, 0.0f);
      std::fill_n(v.data(), len, 0.0f);
      fn(first, len, master + first, m.data(), v.data());
      store_moments(part(unit, StateKind::kExpAvg) + first * mb, m.data(), len, g_.moments);
      store_moments(part(unit, StateKind::kExpAvgSq) + first * mb, v.data(), len, g_.moments);
    }
  }

  size_t concurrent_steps() const override { return 1; }

 private:
  size_t n(int unit) const { return g_.units.at(unit).own_len; }
  size_t moment_bytes(int unit) const { return n(unit) * dtype_size(g_.moments); }
  // The unit's state is in device memory the host cannot read: every access is a copy on
  // stream_, and its Adam step runs on the device.
  bool streamed(int unit) const {
    return stream_ != nullptr &&
           g_.placement.optimizer_home(static_cast<size_t>(unit)) == Tier::kDevice;
  }
  // Elements [first, first + len) of a streamed unit's `kind` array, brought down into `out`
  // (moments widened to fp32 through `raw`) / taken up from `in` (narrowed through `raw`):
  // stream copies, finished when they return. `raw` holds range_bytes(unit).
  void down_range(int unit, StateKind kind, size_t first, size_t len, float* out, std::byte* raw) {
    const DType t = kind == StateKind::kMaster ? DType::F32 : g_.moments;
    const size_t bytes = len * dtype_size(t);
    stream_->copy_d2h(t == DType::F32 ? static_cast<void*>(out) : raw,
                      part(unit, kind) + first * dtype_size(t), bytes);
    stream_->synchronize();
    traffic_.d2h += bytes;
    if (t != DType::F32) load_moments(out, raw, len, t);
  }
  void up_range(int unit, StateKind kind, size_t first, size_t len, const float* in,
                std::byte* raw) {
    const DType t = kind == StateKind::kMaster ? DType::F32 : g_.moments;
    const size_t bytes = len * dtype_size(t);
    if (t != DType::F32) store_moments(raw, in, len, t);
    stream_->copy_h2d(part(unit, kind) + first * dtype_size(t),
                      t == DType::F32 ? static_cast<const void*>(in) : raw, bytes);
    stream_->synchronize();
    traffic_.h2d += bytes;
  }
  size_t range_bytes(int unit) const {
    return std::min(n(unit), kWidenChunk) * dtype_size(g_.moments);
  }

  // The unit's gradients go up (unless they stay on the device: `grads` is device memory
  // then), Adam runs on the device, and new parameters bound for host memory come down; done
  // when it returns. Steps of device units take turns (one scratch).
  void step_on_device(int unit, const float* grads, const cpu_adam::AdamParams& hp, void* out,
                      DType out_dtype) {
    OUTCORE_TRACE_SPAN("adam (device)", "optimizer", {.unit = unit, .lanes = "optimizer"});
    std::lock_guard lock(device_step_m_);
    const size_t len = n(unit);
    try {
      auto* master = reinterpret_cast<float*>(part(unit, StateKind::kMaster));
      const float* dgrads = grads;  // on the device already (they stay there)
      if (!grads_stay_on_device(g_, device_sums_, static_cast<size_t>(unit))) {
        float* up = dev_grads_.as<float>();
        stream_->copy_h2d(up, grads, len * sizeof(float));
        traffic_.h2d += len * sizeof(float);
        dgrads = up;
      }
      const bool out_dev = publishes_on_device(g_, static_cast<size_t>(unit));
      cpu_adam::ParamsOut po;
      if (out != nullptr && out_dtype != DType::F32)
        po = {out_dev ? out : dev_out_.data(), out_dtype};
      device::queue_adam_step(
          *device_, *stream_, hp, len, master, dgrads,
          {part(unit, StateKind::kExpAvg), part(unit, StateKind::kExpAvgSq), g_.moments}, po, &ex_);
      if (out != nullptr) {
        const size_t bytes = len * dtype_size(out_dtype);
        const void* src = out_dtype == DType::F32 ? master : po.data;
        if (out_dev) {
          if (src != out) stream_->copy_d2d(out, src, bytes);
        } else {
          stream_->copy_d2h(out, src, bytes);
          traffic_.d2h += bytes;
        }
      }
      stream_->synchronize();
    } catch (...) {
      // Nothing queued may outlive the step: `grads` and `out` are the caller's, and the next
      // step reuses the scratch.
      try {
        stream_->synchronize();
      } catch (...) {
      }
      throw;
    }
  }

  // Ranges of kWidenChunk elements through host buffers.
  void visit_on_device(int unit, const swap::OptimizerSwapper::StateVisitor& fn) {
    const size_t chunk = std::min(n(unit), kWidenChunk);
    std::vector<float> master(chunk), m(chunk), v(chunk);
    std::vector<std::byte> raw(range_bytes(unit));
    for (size_t first = 0; first < n(unit); first += kWidenChunk) {
      const size_t len = std::min(kWidenChunk, n(unit) - first);
      down_range(unit, StateKind::kMaster, first, len, master.data(), raw.data());
      down_range(unit, StateKind::kExpAvg, first, len, m.data(), raw.data());
      down_range(unit, StateKind::kExpAvgSq, first, len, v.data(), raw.data());
      fn(first, len, master.data(), m.data(), v.data());
    }
  }
  void fill_on_device(int unit, const swap::OptimizerSwapper::StateFiller& fn) {
    const size_t chunk = std::min(n(unit), kWidenChunk);
    std::vector<float> master(chunk), m(chunk), v(chunk);
    std::vector<std::byte> raw(range_bytes(unit));
    for (size_t first = 0; first < n(unit); first += kWidenChunk) {
      const size_t len = std::min(kWidenChunk, n(unit) - first);
      std::fill_n(m.data(), len, 0.0f);
      std::fill_n(v.data(), len, 0.0f);
      fn(first, len, master.data(), m.data(), v.data());
      up_range(unit, StateKind::kMaster, first, len, master.data(), raw.data());
      up_range(unit, StateKind::kExpAvg, first, len, m.data(), raw.data());
      up_range(unit, StateKind::kExpAvgSq, first, len, v.data(), raw.data());
    }
  }
  std::byte* part(int unit, StateKind kind) {
    std::byte* base = base_.at(unit);
    if (base == nullptr)
      throw InvalidArgument(
          fmt::format("zero: the optimizer state of unit {} is not in memory", unit));
    if (kind == StateKind::kMaster) return base;
    const size_t master = n(unit) * sizeof(float);
    return base + master + (kind == StateKind::kExpAvg ? 0 : moment_bytes(unit));
  }

  const Geometry& g_;
  const cpu_adam::Executor& ex_;
  TrafficCounters& traffic_;
  device::Device* device_;
  const std::vector<bool> device_sums_;  // Plan::device_grad_sums
  device::DeviceBuffer dev_grads_, dev_out_;
  std::mutex device_step_m_;
  std::vector<device::DeviceBuffer> dev_;
  std::vector<AlignedBuffer> host_;
  std::vector<std::byte*> base_;  // per unit: [master | exp_avg | exp_avg_sq], null on NVMe
  // Set when device units are streamed(). Last: destroyed first, its destructor waits for what
  // was queued on the buffers above (a constructor or a step that threw midway).
  std::unique_ptr<device::Stream> stream_;
};

class NvmeOptimizerStore final : public OptimizerStore {
 public:
  NvmeOptimizerStore(const Geometry& g, swap::Swapper& swapper, swap::PinnedPool& pool,
                     const swap::OptimizerSwapperOptions& options, size_t concurrent,
                     device::Device* device, const cpu_adam::Executor& ex, TrafficCounters& traffic,
                     const std::vector<bool>& device_sums)
      : g_(g), swapper_(swapper, pool, options, &ex), concurrent_(concurrent) {
    if (g.placement.device_optimizer_from < g.units.size())
      memory_ = std::make_unique<MemoryOptimizerStore>(g, device, ex, traffic, device_sums);
  }

  void init(int unit, std::span<const float> master) override {
    if (in_memory(unit)) return memory_->init(unit, master);
    check_len("initial master weights", unit, master.size(), n(unit));
    // The last sub-groups are written while the engine draws the next unit's weights.
    swapper_.init_state_async(static_cast<uint32_t>(unit), master);
  }
  void flush() override { swapper_.flush(); }

  void step(int unit, const float* grads, const cpu_adam::AdamParams& hp, void* out,
            DType out_dtype) override {
    if (in_memory(unit)) return memory_->step(unit, grads, hp, out, out_dtype);
    swapper_.step(static_cast<uint32_t>(unit), {grads, n(unit)}, hp, {out, out_dtype});
  }

  void read(int unit, StateKind kind, std::span<float> out) override {
    if (in_memory(unit)) return memory_->read(unit, kind, out);
    check_len("state read", unit, out.size(), n(unit));
    if (kind == StateKind::kMaster) return swapper_.read_master(static_cast<uint32_t>(unit), out);
    std::vector<float> a(n(unit)), b(n(unit));
    if (kind == StateKind::kExpAvg)
      swapper_.read_state(static_cast<uint32_t>(unit), a, out, b);
    else
      swapper_.read_state(static_cast<uint32_t>(unit), a, b, out);
  }

  void write(int unit, StateKind kind, std::span<const float> in) override {
    if (in_memory(unit)) return memory_->write(unit, kind, in);
    check_len("state write", unit, in.size(), n(unit));
    const uint32_t u = static_cast<uint32_t>(unit);
    std::vector<float> s[3];
    for (auto& v : s) v.resize(n(unit));
    swapper_.read_state(u, s[0], s[1], s[2]);
    std::memcpy(s[static_cast<int>(kind)].data(), in.data(), in.size_bytes());
    swapper_.load_state(u, s[0], s[1], s[2], swapper_.steps_done(u));
  }

  void visit(int unit, const swap::OptimizerSwapper::StateVisitor& fn) override {
    if (in_memory(unit)) return memory_->visit(unit, fn);
    swapper_.visit_state(static_cast<uint32_t>(unit), n(unit), fn);
  }

  void fill(int unit, const swap::OptimizerSwapper::StateFiller& fn) override {
    if (in_memory(unit)) return memory_->fill(unit, fn);
    const uint32_t u = static_cast<uint32_t>(unit);
    swapper_.fill_state(u, n(unit), fn, swapper_.steps_done(u));
  }

  size_t concurrent_steps() const override { return concurrent_; }

  bool can_step_tentatively(int unit) const override {
    return !in_memory(unit) && swapper_.options().spare_copy;
  }
  void step_tentative(int unit, const float* grads, const cpu_adam::AdamParams& hp, void* out,
                      DType out_dtype) override {
    if (!can_step_tentatively(unit))
      return OptimizerStore::step_tentative(unit, grads, hp, out, out_dtype);
    swapper_.step_tentative(static_cast<uint32_t>(unit), {grads, n(unit)}, hp, {out, out_dtype});
  }
  void commit(int unit) override { swapper_.commit(static_cast<uint32_t>(unit)); }
  void discard(int unit) override { swapper_.discard(static_cast<uint32_t>(unit)); }

 private:
  size_t n(int unit) const { return g_.units.at(unit).own_len; }
  bool in_memory(int unit) const {
    return g_.placement.optimizer_home(static_cast<size_t>(unit)) != Tier::kNvme;
  }

  const Geometry& g_;
  swap::OptimizerSwapper swapper_;
  size_t concurrent_;
  std::unique_ptr<MemoryOptimizerStore> memory_;  // offload_optimizer.ratio < 1: device units
};

}  // namespace

void OptimizerStore::step_tentative(int unit, const float*, const cpu_adam::AdamParams&, void*,
                                    DType) {
  throw InvalidArgument(fmt::format("zero: unit {} cannot step tentatively", unit));
}
void OptimizerStore::commit(int unit) {
  throw InvalidArgument(fmt::format("zero: unit {} has no tentative step", unit));
}
void OptimizerStore::discard(int unit) { commit(unit); }

std::unique_ptr<OptimizerStore> make_memory_store(const Geometry& g, device::Device* device,
                                                  const cpu_adam::Executor& ex,
                                                  TrafficCounters& traffic,
                                                  const std::vector<bool>& device_sums) {
  return std::make_unique<MemoryOptimizerStore>(g, device, ex, traffic, device_sums);
}

std::unique_ptr<OptimizerStore> make_nvme_store(
    const Geometry& g, swap::Swapper& swapper, swap::PinnedPool& pool,
    const swap::OptimizerSwapperOptions& options, size_t concurrent_steps, device::Device* device,
    const cpu_adam::Executor& ex, TrafficCounters& traffic, const std::vector<bool>& device_sums) {
  return std::make_unique<NvmeOptimizerStore>(g, swapper, pool, options,
                                              std::max<size_t>(1, concurrent_steps), device, ex,
                                              traffic, device_sums);
}

}  // namespace outcore::zero::detail
