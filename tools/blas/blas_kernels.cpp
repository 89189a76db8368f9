#include "tools/blas/blas_kernels.hpp"

#include <cblas.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdlib>

namespace outcore::tools {

CpuVectorFeatures cpu_vector_features() {
  __builtin_cpu_init();
  CpuVectorFeatures f;
  f.avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512cd") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("avx512vl");
  f.avx2_fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return f;
}

std::optional<std::string> better_blas_kernels(std::string_view corename,
                                               const CpuVectorFeatures& features) {
  std::string core(corename);
  std::transform(core.begin(), core.end(), core.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  // OpenBLAS's x86-64 kernel sets without AVX2: what an unrecognised CPU falls back to.
  constexpr std::array<std::string_view, 9> kFallbacks{"prescott",   "core2",     "penryn",
                                                       "dunnington", "nehalem",   "atom",
                                                       "katmai",     "northwood", "unknown"};
  if (std::find(kFallbacks.begin(), kFallbacks.end(), core) == kFallbacks.end()) return {};
  if (features.avx512) return "SkylakeX";
  if (features.avx2_fma) return "Haswell";
  return {};
}

std::string blas_kernel_name() {
  const char* name = openblas_get_corename();
  return name != nullptr ? name : "unknown";
}

void select_blas_kernels(char** argv) {
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) return;
  const std::optional<std::string> better =
      better_blas_kernels(blas_kernel_name(), cpu_vector_features());
  if (!better) return;
  if (::setenv("OPENBLAS_CORETYPE", better->c_str(), 1) != 0) return;
  ::execv("/proc/self/exe", argv);
  ::unsetenv("OPENBLAS_CORETYPE");  // exec failed: go on with the detected kernels
}

int local_ranks() {
  for (const char* var :
       {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "PMIX_LOCAL_SIZE", "LOCAL_WORLD_SIZE"}) {
    if (const char* v = std::getenv(var); v != nullptr && std::atoi(v) > 0) return std::atoi(v);
  }
  return 1;
}

void select_openmp_waiting(char** argv) {
  if (local_ranks() < 2 || std::getenv("OMP_WAIT_POLICY") != nullptr ||
      std::getenv("GOMP_SPINCOUNT") != nullptr)
    return;
  if (::setenv("OMP_WAIT_POLICY", "passive", 1) != 0) return;
  ::execv("/proc/self/exe", argv);
  ::unsetenv("OMP_WAIT_POLICY");  // exec failed: go on spinning
}

}  // namespace outcore::tools
