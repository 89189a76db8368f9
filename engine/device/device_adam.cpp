#include "engine/device/device_adam.hpp"

#include <fmt/format.h>

#include "common/error.hpp"
#include "engine/device/cuda/cuda_kernels.hpp"

namespace outcore::device {

void queue_adam_step(Device& device, Stream& stream, const cpu_adam::AdamParams& hp, size_t n,
                     float* master, const float* grads, const cpu_adam::Moments& moments,
                     cpu_adam::ParamsOut out, const cpu_adam::Executor* executor) {
  cpu_adam::validate(hp);
  if (n > 0 && (master == nullptr || grads == nullptr || moments.exp_avg == nullptr ||
                moments.exp_avg_sq == nullptr))
    throw InvalidArgument(
        fmt::format("device Adam: {} elements with a null master, gradient or moment array", n));
  if (moments.dtype != DType::F32 && moments.dtype != DType::BF16)
    throw InvalidArgument("device Adam: the Adam moments must be fp32 or bf16");
  if (out.data != nullptr && out.dtype != DType::BF16 && out.dtype != DType::F16)
    throw InvalidArgument("device Adam: the parameter copy-out must be bf16 or fp16");
  if (n == 0) return;
  if (device.kind() == DeviceKind::Cuda) {
    cuda::adam_step(cpu_adam::adam_coefficients(hp), hp.formula == cpu_adam::Formula::kPyTorch,
                    static_cast<int64_t>(n), master, grads, moments.exp_avg, moments.exp_avg_sq,
                    moments.dtype == DType::BF16, out.data, out.dtype, stream.native_handle());
    return;
  }
  // A discrete CpuDevice's memory through its host view; other host devices' as it is.
  const auto* cpu = dynamic_cast<const CpuDevice*>(&device);
  const auto view = [cpu](const void* ptr) {
    return cpu != nullptr ? cpu->host_view(ptr) : const_cast<void*>(ptr);
  };
  float* p = static_cast<float*>(view(master));
  const auto* g = static_cast<const float*>(view(grads));
  const cpu_adam::Moments m{view(moments.exp_avg), view(moments.exp_avg_sq), moments.dtype};
  const cpu_adam::ParamsOut o{out.data == nullptr ? nullptr : view(out.data), out.dtype};
  stream.enqueue([hp, n, p, g, m, o, executor] {
    cpu_adam::adam_step(hp, n, p, {g, DType::F32}, m, o, executor);
  });
}

}  // namespace outcore::device
