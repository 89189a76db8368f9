// Which OpenBLAS kernels a program runs. OpenBLAS built for many CPUs (Debian's, DYNAMIC_ARCH)
// picks its kernels from the CPU model when it loads; a CPU newer than the library is not
// recognised and gets the Prescott (SSE3) kernels, a third to a quarter of the sgemm rate of the
// AVX-512 or AVX2 kernels the CPU runs. Programs call select_blas_kernels() first thing in
// main: where that fallback happened and the CPU has AVX-512 or AVX2, it runs the program
// again (same pid, arguments and environment) with OPENBLAS_CORETYPE naming the kernels for
// those instructions, which OpenBLAS reads when it loads. A set OPENBLAS_CORETYPE is left alone,
// so the user can choose, and child processes inherit the choice (the same kernels everywhere,
// so a run is bit-identical whichever process computes it). Link outcore_blas_kernels.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace outcore::tools {

struct CpuVectorFeatures {
  bool avx512 = false;  // AVX-512 F, CD, BW, DQ and VL (OpenBLAS's SkylakeX kernels)
  bool avx2_fma = false;
};

CpuVectorFeatures cpu_vector_features();

// The OPENBLAS_CORETYPE for a CPU with `features` whose detected kernel set is `corename`
// (openblas_get_corename()): "SkylakeX" or "Haswell" where `corename` is one of OpenBLAS's
// pre-AVX2 fallbacks (Prescott, Core2, ...) and the CPU has more; nothing otherwise.
std::optional<std::string> better_blas_kernels(std::string_view corename,
                                               const CpuVectorFeatures& features);

// The kernel set OpenBLAS runs in this process (openblas_get_corename()).
std::string blas_kernel_name();

// See the top of this file. Returns only where nothing is to be done or the exec failed.
void select_blas_kernels(char** argv);

// The ranks a launcher started on this node (OMPI_COMM_WORLD_LOCAL_SIZE, MPI_LOCALNRANKS,
// PMIX_LOCAL_SIZE or LOCAL_WORLD_SIZE; 1 when none is set).
int local_ranks();

// For a program that may run as one of several ranks on a node: there, with neither
// OMP_WAIT_POLICY nor GOMP_SPINCOUNT set, runs the program again with OMP_WAIT_POLICY=passive,
// which OpenMP reads when it loads. Each rank's bf16 GEMMs run on an OpenMP team of every
// processor (the same number as a single-rank run, so that they sum alike); by default a team's
// idle threads spin for a while after each GEMM, taking the cores the other ranks need, while
// passive threads sleep. Returns only where nothing is to be done or the exec failed.
void select_openmp_waiting(char** argv);

}  // namespace outcore::tools
