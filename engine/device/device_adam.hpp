// Adam and the gradient norm's block sums on a device's memory: the step of optimizer state
// kept on a device the host cannot read (stage 0, offload_optimizer none, or the last units by a
// ratio < 1; decision 036), and the norm of the gradients that stay there for it (decision
// 037), queued on a stream of that device like its copies.
//
// The arithmetic is cpu_adam's, element for element (cpu_adam::math::adam_element) and lane for
// lane (cpu_adam::math::square_lane), so state stepped here and sums taken here have the same
// bits as cpu_adam::adam_step and cpu_adam::block_sums_of_squares give in host memory:
//   CpuDevice   cpu_adam's call on the stream's thread, through the device's host view (a
//               discrete CpuDevice's memory is not the host's), on `executor`'s threads
//   CudaDevice  cuda::adam_step / cuda::block_sums_of_squares
//               (engine/device/cuda/cuda_kernels.hpp) on the stream
#pragma once

#include <cstddef>

#include "cpu_adam/cpu_adam.hpp"
#include "engine/device/device.hpp"

namespace outcore::device {

// Queues one Adam step over n elements on `stream` of `device` and returns: `master`, `grads`
// (fp32), the moments and `out` (nullable; BF16 or F16) are device memory of `device`, valid
// and unread by others until the stream has run it (wait for an event recorded after it, or
// synchronize). `executor` (nullable) must outlive the step. Throws InvalidArgument on the
// calling thread for invalid `hp`, a null array with n > 0, a moments dtype other than F32 or
// BF16, or an F32 `out`; an error while it runs becomes the stream's.
void queue_adam_step(Device& device, Stream& stream, const cpu_adam::AdamParams& hp, size_t n,
                     float* master, const float* grads, const cpu_adam::Moments& moments,
                     cpu_adam::ParamsOut out, const cpu_adam::Executor* executor);

// Queues cpu_adam::block_sums_of_squares(x, F32, n, block, out) on `stream` of `device` and
// returns: `x` (n fp32 elements) and `out` (ceil(n / block) doubles) are device memory of
// `device`, under the same rules as queue_adam_step's arrays. Throws InvalidArgument on the
// calling thread for block == 0 or a null array with n > 0.
void queue_block_sums_of_squares(Device& device, Stream& stream, const float* x, size_t n,
                                 size_t block, double* out, const cpu_adam::Executor* executor);

}  // namespace outcore::device
