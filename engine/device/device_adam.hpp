// Adam on a device's memory: the step of optimizer state kept on a device the host cannot read
// (stage 0, offload_optimizer none, or the last units by a ratio < 1; decision 036), queued on
// a stream of that device like its copies.
//
// The arithmetic is cpu_adam's, element for element (cpu_adam::math::adam_element), so state
// stepped here has the same bits as state stepped by cpu_adam::adam_step in host memory:
//   CpuDevice   cpu_adam::adam_step on the stream's thread, through the device's host view
//               (a discrete CpuDevice's memory is not the host's), on `executor`'s threads
//   CudaDevice  cuda::adam_step (engine/device/cuda/cuda_kernels.hpp) on the stream
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

}  // namespace outcore::device
