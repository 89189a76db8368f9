// The settings the libraries take as arguments but users give through the environment, read
// in one place. Only programs (tools/, bench/, examples/, the Python module and the test
// programs' main, which applies the compute backend's part) include this: no library reads the
// environment.
//
//   OUTCORE_AIO_BACKEND=io_uring|sync   -> aio::request_backend() (unset: chosen automatically)
//   OUTCORE_CPU_ADAM_ISA=scalar|avx2|avx512 -> cpu_adam::request_isa() (unset: best the CPU runs)
//   OUTCORE_CUBLASLT_WORKSPACE_MB=N     -> device::request_gemm_workspace() (unset: 0)
//   OMPI_COMM_WORLD_LOCAL_SIZE, MPI_LOCALNRANKS, PMIX_LOCAL_SIZE or LOCAL_WORLD_SIZE = R > 1 (the
//   ranks a launcher started on this node), OMP_NUM_THREADS unset
//                                       -> device::cpu::set_bf16_gemm_threads(processors / R)
//
// Link the CMake target outcore_env_settings.
#pragma once

#include <sched.h>

#include <algorithm>
#include <cstdlib>

#include "aio/aio.hpp"
#include "cpu_adam/cpu_adam.hpp"
#include "engine/device/compute_backend.hpp"
#include "engine/device/cpu/bf16_gemm.hpp"

namespace outcore::tools {

// The ranks a launcher started on this node (1 when none says).
inline int local_ranks() {
  for (const char* var :
       {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "PMIX_LOCAL_SIZE", "LOCAL_WORLD_SIZE"}) {
    if (const char* v = std::getenv(var); v != nullptr && std::atoi(v) > 0) return std::atoi(v);
  }
  return 1;
}

// The compute backend's settings alone: cuBLASLt's workspace, and with several ranks on this
// node (and OMP_NUM_THREADS unset) the CPU's bf16 GEMM threads, the processors this process may
// run on divided among the ranks, so that the ranks' OpenMP teams do not spin for each other's
// cores. What the test programs' main takes too, so that `./dev.sh gpu` runs the GPU tests with
// either.
// Never throws.
inline void apply_compute_settings() {
  if (const char* mib = std::getenv("OUTCORE_CUBLASLT_WORKSPACE_MB")) {
    device::request_gemm_workspace(mib, "OUTCORE_CUBLASLT_WORKSPACE_MB");
  }
  if (const int ranks = local_ranks(); ranks > 1 && std::getenv("OMP_NUM_THREADS") == nullptr) {
    cpu_set_t cpus;
    CPU_ZERO(&cpus);
    const int procs = sched_getaffinity(0, sizeof(cpus), &cpus) == 0 ? CPU_COUNT(&cpus) : 1;
    device::cpu::set_bf16_gemm_threads(std::max(1, procs / ranks));
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
