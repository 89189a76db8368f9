// CUDA_CHECK: runs a CUDA runtime call and throws outcore::Error naming the statement, the
// error, the file and the line when it fails. Internal to engine/device/cuda (.cu files only).
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "common/error.hpp"

namespace outcore::device::detail {

[[noreturn]] inline void throw_cuda_error(cudaError_t err, const char* stmt, const char* file,
                                          int line) {
  throw Error(std::string("CUDA error ") + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) +
              ") in `" + stmt + "` at " + file + ":" + std::to_string(line));
}

}  // namespace outcore::device::detail

#define CUDA_CHECK(stmt)                                                                       \
  do {                                                                                         \
    cudaError_t cuda_check_err_ = (stmt);                                                      \
    if (cuda_check_err_ != cudaSuccess)                                                        \
      ::outcore::device::detail::throw_cuda_error(cuda_check_err_, #stmt, __FILE__, __LINE__); \
  } while (0)
