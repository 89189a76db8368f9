#include "engine/zero/step_bounds.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>

#include "common/aligned_buffer.hpp"
#include "common/error.hpp"
#include "cpu_adam/cpu_adam.hpp"
#include "engine/device/compute_backend.hpp"
#include "engine/zero/zero.hpp"

namespace outcore::zero {

double StepTimes::bound_s() const { return std::max({compute_s, pcie_s, drive_s, adam_s}); }

std::string StepTimes::bound() const {
  const double most = bound_s();
  if (compute_s == most) return "compute";
  if (pcie_s == most) return "PCIe";
  return drive_s == most ? "drive" : "CPU Adam";
}

StepTimes step_times(const Plan& plan, const model::LlamaModel& model, const LinkRates& rates) {
  StepTimes t;
  const model::ModelOptions& o = model.options();
  const double tokens = static_cast<double>(plan.tokens_per_micro_batch) *
                        static_cast<double>(plan.micro_batches_per_step);
  const model::LlamaConfig& c = model.config();
  const bool again = o.activation_checkpointing;  // each decoder's forward again in backward
  t.flops = (c.train_flops_per_token(o.seq_len) +
             (again ? c.recompute_flops_per_token(o.seq_len) : 0.0)) *
            tokens;
  t.attention_flops = (again ? 4.0 : 3.0) * c.attention_flops_per_token(o.seq_len) * tokens;
  if (rates.gemm_flops > 0) {
    const double attention_rate =
        rates.attention_flops > 0 ? rates.attention_flops : rates.gemm_flops;
    t.gemm_s = (t.flops - t.attention_flops) / rates.gemm_flops;
    t.attention_s = t.attention_flops / attention_rate;
    t.compute_s = t.gemm_s + t.attention_s;
  }
  const double copied = static_cast<double>(plan.per_step.h2d + plan.per_step.d2h);
  t.pcie_s = rates.pcie_bytes > 0 ? copied / rates.pcie_bytes : 0;
  const double nr = static_cast<double>(plan.per_step.nvme_read);
  const double nw = static_cast<double>(plan.per_step.nvme_write);
  if (nr + nw > 0 && (rates.drive_read_bytes <= 0 || rates.drive_write_bytes <= 0)) {
    t.drive_known = false;
  } else if (nr + nw > 0) {
    t.drive_s = nr / rates.drive_read_bytes + nw / rates.drive_write_bytes;
  }
  t.adam_elems = cpu_adam_elems(plan);
  if (rates.adam_elems > 0) t.adam_s = static_cast<double>(t.adam_elems) / rates.adam_elems;
  return t;
}

uint64_t cpu_adam_elems(const Plan& plan) {
  return plan.device_host_accessible ? plan.optimizer_elems : plan.offloaded_optimizer_elems;
}

double measure_adam_rate(const config::Config& cfg, DType param_dtype, size_t elems) {
  const cpu_adam::Executor ex(cpu_threads_for(cfg));
  const DType moments = config::adam_moments_bf16(cfg) ? DType::BF16 : DType::F32;
  const size_t mb = dtype_size(moments);
  AlignedBuffer p(elems * sizeof(float)), g(elems * sizeof(float)), m(elems * mb), v(elems * mb);
  AlignedBuffer out(param_dtype == DType::F32 ? 0 : elems * dtype_size(param_dtype));
  float* grads = g.as<float>().data();
  // Small gradients and zero moments: finite values throughout (the buffers start zeroed).
  ex.for_chunks(elems, 1 << 16, 1 << 16, [&](size_t, size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) grads[i] = 1e-3f * static_cast<float>(i % 7);
  });
  cpu_adam::AdamParams hp;
  const cpu_adam::ParamsOut po{out.size() > 0 ? out.data() : nullptr,
                               param_dtype == DType::F16 ? DType::F16 : DType::BF16};
  double best = HUGE_VAL;
  for (int k = 0; k < 4; ++k) {
    hp.step = static_cast<uint64_t>(k) + 1;
    const auto t0 = std::chrono::steady_clock::now();
    cpu_adam::adam_step(hp, elems, p.as<float>().data(), {grads, DType::F32},
                        {m.data(), v.data(), moments}, po, &ex);
    const std::chrono::duration<double> d = std::chrono::steady_clock::now() - t0;
    if (k > 0) best = std::min(best, d.count());
  }
  return static_cast<double>(elems) / best;
}

device::ComputeBackend::Attention rate_attention(const model::LlamaModel& model,
                                                 int64_t max_tokens) {
  device::ComputeBackend::Attention a = model.workspace_shape().attention;
  a.B = 1;
  a.T = std::min(a.T, std::max<int64_t>(max_tokens, 1));
  a.block = std::min(a.block, a.T);
  return a;
}

RateShapes rate_shapes(const device::Device& device) {
  if (device.kind() == device::DeviceKind::Cuda) return {.gemm_n = 4096, .attention_tokens = 4096};
  return {.gemm_n = 1024, .attention_tokens = 512};
}

void measure_compute_rates(device::Device& device, const model::LlamaModel& model,
                           LinkRates& rates) {
  if (rates.gemm_flops > 0 && rates.attention_flops > 0) return;
  const RateShapes at = rate_shapes(device);
  const std::shared_ptr<device::ComputeBackend> backend = device::make_backend(device);
  if (rates.gemm_flops <= 0)
    rates.gemm_flops =
        device::gemm_flops(device, *backend, model.options().compute_dtype, at.gemm_n);
  if (rates.attention_flops <= 0)
    rates.attention_flops =
        device::attention_flops(device, *backend, rate_attention(model, at.attention_tokens));
}

uint64_t cuda_workspace_bytes(const model::LlamaModel& model) {
  return device::backend_workspace(device::DeviceKind::Cuda, model.workspace_shape()).total();
}

std::optional<StepTimes> shape_times(const config::Config& cfg, const model::LlamaConfig& mc,
                                     model::ModelOptions mo, int64_t micro, int64_t gas,
                                     const PlanOptions& po, uint64_t device_limit,
                                     uint64_t head_bytes, const LinkRates& rates) {
  config::Config c = cfg;
  c.train_micro_batch_size_per_gpu.set(micro);
  c.gradient_accumulation_steps.set(gas);
  c.train_batch_size.set(micro * gas * po.world_size);
  mo.micro_batch = micro;
  if (head_bytes > 0 && mo.head_chunk_rows > 0)
    mo.head_chunk_rows = model::head_rows_for_device(mc, mo, head_bytes);
  try {
    const model::LlamaModel m(mc, mo);
    PlanOptions shaped = po;
    if (!po.device_host_accessible) shaped.compute_workspace_bytes = cuda_workspace_bytes(m);
    const Plan plan = make_plan(c, m, shaped);
    PlanLimits limits = system_limits(c, plan);
    if (device_limit > 0) limits.device = device_limit;
    apply_machine(limits, po);
    check_fits(plan, limits);
    return step_times(plan, m, rates);
  } catch (const Error&) {
    return std::nullopt;
  }
}

std::optional<ShapeChoice> choose_shape(const config::Config& cfg, const model::LlamaConfig& mc,
                                        const model::ModelOptions& mo, const PlanOptions& po,
                                        uint64_t device_limit, uint64_t head_bytes,
                                        const LinkRates& rates) {
  // compute over the larger transfer: at least 1 when the transfers hide under compute
  const auto cover = [](const StepTimes& t) {
    const double transfer = std::max(t.pcie_s, t.drive_s);
    return transfer > 0 ? t.compute_s / transfer : HUGE_VAL;
  };
  std::optional<ShapeChoice> best, closest;
  for (int64_t micro = 1; micro <= 64; micro *= 2)
    for (int64_t gas = 1; gas <= 128; gas *= 2) {
      const std::optional<StepTimes> times =
          shape_times(cfg, mc, mo, micro, gas, po, device_limit, head_bytes, rates);
      if (!times) continue;
      const ShapeChoice c{micro, gas, *times, times->transfers_hidden()};
      if (!closest || cover(c.times) > cover(closest->times)) closest = c;
      if (c.hides && (!best || micro * gas < best->micro * best->gas)) best = c;
    }
  return best ? best : closest;
}

}  // namespace outcore::zero
