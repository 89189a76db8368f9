// The settings the libraries take as arguments but users give through the environment, read
// in one place. Only programs (tools/, bench/, examples/, the Python module and the test
// programs' main, which applies the compute backend's part) include this: no library reads the
// environment.
//
//   OUTCORE_AIO_BACKEND=io_uring|sync   -> aio::request_backend() (unset: chosen automatically)
//   OUTCORE_CPU_ADAM_ISA=scalar|avx2|avx512 -> cpu_adam::request_isa() (unset: best the CPU runs)
//   OUTCORE_CUBLASLT_WORKSPACE_MB=N     -> device::request_gemm_workspace() (unset: 0)

// Link the CMake target outcore_env_settings.
#pragma once

#include <cstdlib>

#include "aio/aio.hpp"
#include "cpu_adam/cpu_adam.hpp"
#include "engine/device/compute_backend.hpp"

namespace outcore::tools {

// The compute backend's settings alone (cuBLASLt's workspace): what the test programs' main
// takes too, so that `./dev.sh gpu` runs the GPU tests with either.
// Never throws.
inline void apply_compute_settings() {
  if (const char* mib = std::getenv("OUTCORE_CUBLASLT_WORKSPACE_MB")) {
    device::request_gemm_workspace(mib, "OUTCORE_CUBLASLT_WORKSPACE_MB");
  }
}

// Passes the variables to their libraries, naming each variable as the source of its value
// so that errors and warnings name it. Call it at the start of main (before any aio::Engine or
// cpu_adam kernel call). A bad value is reported where the library reports it: the aio backend
// on the first aio::resolve_backend() (ConfigError), the ISA and the workspace at once
// (one warning, ignored).
// Never throws.
inline void apply_environment_settings() {
  const char* backend = std::getenv("OUTCORE_AIO_BACKEND");
  aio::request_backend(backend != nullptr ? backend : "", "OUTCORE_AIO_BACKEND");
  if (const char* isa = std::getenv("OUTCORE_CPU_ADAM_ISA")) {
    cpu_adam::request_isa(isa, "OUTCORE_CPU_ADAM_ISA");
  }
  apply_compute_settings();
}

}  // namespace outcore::tools
