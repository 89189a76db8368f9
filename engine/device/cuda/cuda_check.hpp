// CUDA_CHECK: runs a CUDA runtime call and throws outcore::Error naming the statement, the
// error, the file and the line when it fails; LAUNCHED() does so after a kernel launch (and, for a
// fault of work queued earlier, saying so and how to find the operation). Internal to
// engine/device/cuda (.cu files only).
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "common/error.hpp"

namespace outcore::device::detail {

// Whether `err` is a fault of work already queued (a kernel's or a copy's), reported by whatever
// CUDA call comes next: the device's context is lost and every later call fails too.
inline bool queued_work_failed(cudaError_t err) {
  switch (err) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorMisalignedAddress:
    case cudaErrorIllegalInstruction:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorHardwareStackError:
    case cudaErrorAssert:
    case cudaErrorLaunchTimeout:
    case cudaErrorECCUncorrectable:
      return true;
    default:
      return false;
  }
}

[[noreturn]] inline void throw_cuda_error(cudaError_t err, const char* stmt, const char* file,
                                          int line) {
  throw Error(std::string("CUDA error ") + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) +
              ") in `" + stmt + "` at " + file + ":" + std::to_string(line) +
              (queued_work_failed(err)
                   ? ": a kernel or copy queued before this call failed, and the GPU's context is "
                     "lost (the run cannot go on); CUDA_LAUNCH_BLOCKING=1 reports it at the "
                     "operation that failed"
                   : ""));
}

}  // namespace outcore::device::detail

#define CUDA_CHECK(stmt)                                                                       \
  do {                                                                                         \
    cudaError_t cuda_check_err_ = (stmt);                                                      \
    if (cuda_check_err_ != cudaSuccess)                                                        \
      ::outcore::device::detail::throw_cuda_error(cuda_check_err_, #stmt, __FILE__, __LINE__); \
  } while (0)

// After a kernel launch: a launch that failed (a bad configuration, too much shared memory)
// throws naming the function that launched it (the operation), the file and the line.
#define LAUNCHED()                                                                                 \
  do {                                                                                             \
    const cudaError_t launch_err_ = cudaGetLastError();                                            \
    if (launch_err_ != cudaSuccess)                                                                \
      ::outcore::device::detail::throw_cuda_error(                                                 \
          launch_err_, (std::string("the kernel launch of ") + __func__ + "()").c_str(), __FILE__, \
          __LINE__);                                                                               \
  } while (0)
