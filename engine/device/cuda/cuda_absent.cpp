// probe(), make_cuda_device() and the kernels the engine calls directly, for builds without nvcc.
#include "common/error.hpp"
#include "engine/device/compute_backend.hpp"
#include "engine/device/cuda/cuda_kernels.hpp"
#include "engine/device/device.hpp"

namespace outcore::device {

bool cuda_compiled() { return false; }

ProbeResult probe() {
  ProbeResult result;
  result.reason = "built without CUDA (nvcc was not found at configure time)";
  return result;
}

std::unique_ptr<Device> make_cuda_device(CudaDeviceOptions) {
  throw InvalidArgument("cannot create a CUDA device: " + probe().summary());
}

std::unique_ptr<ComputeBackend> make_cuda_backend(Device& device) {
  throw InvalidArgument("cannot compute on " + device.name() + ": " + probe().summary());
}

namespace cuda {

void adam_step(const cpu_adam::detail::AdamCoeffs&, bool, int64_t, float*, const float*, void*,
               void*, bool, void*, DType, StreamHandle) {
  throw InvalidArgument("cannot run Adam on a GPU: " + probe().summary());
}

void block_sums_of_squares(const float*, int64_t, int64_t, double*, StreamHandle) {
  throw InvalidArgument("cannot take sums of squares on a GPU: " + probe().summary());
}

}  // namespace cuda

}  // namespace outcore::device
