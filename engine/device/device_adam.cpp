#include "engine/device/device_adam.hpp"

#include <fmt/format.h>

#include "common/error.hpp"
#include "engine/device/cuda/cuda_kernels.hpp"

namespace outcore::device {
namespace {

// A discrete CpuDevice's memory through its host view; other host devices' as it is.
class HostView {
 public:
  explicit HostView(const Device& device) : cpu_(dynamic_cast<const CpuDevice*>(&device)) {}
  void* operator()(const void* ptr) const {
    return cpu_ != nullptr ? cpu_->host_view(ptr) : const_cast<void*>(ptr);
  }

 private:
  const CpuDevice* cpu_;
};

}  // namespace

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
  const HostView view(device);
  float* p = static_cast<float*>(view(master));
  const auto* g = static_cast<const float*>(view(grads));
  const cpu_adam::Moments m{view(moments.exp_avg), view(moments.exp_avg_sq), moments.dtype};
  const cpu_adam::ParamsOut o{out.data == nullptr ? nullptr : view(out.data), out.dtype};
  stream.enqueue([hp, n, p, g, m, o, executor] {
    cpu_adam::adam_step(hp, n, p, {g, DType::F32}, m, o, executor);
  });
}

void queue_block_sums_of_squares(Device& device, Stream& stream, const float* x, size_t n,
                                 size_t block, double* out, const cpu_adam::Executor* executor) {
  if (block == 0) throw InvalidArgument("device block sums of squares: block size must be > 0");
  if (n > 0 && (x == nullptr || out == nullptr))
    throw InvalidArgument(
        fmt::format("device block sums of squares: {} elements with a null array", n));
  if (n == 0) return;
  if (device.kind() == DeviceKind::Cuda) {
    cuda::block_sums_of_squares(x, static_cast<int64_t>(n), static_cast<int64_t>(block), out,
                                stream.native_handle());
    return;
  }
  const HostView view(device);
  const auto* hx = static_cast<const float*>(view(x));
  auto* hout = static_cast<double*>(view(out));
  stream.enqueue([hx, n, block, hout, executor] {
    cpu_adam::block_sums_of_squares(hx, DType::F32, n, block, hout, executor);
  });
}

}  // namespace outcore::device
