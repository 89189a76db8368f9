// tools/blas: the choice of OpenBLAS kernels, and that this test program (whose main makes the
// choice, as every outcore program's does) runs the best kernels its CPU allows.
#include "tools/blas/blas_kernels.hpp"

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

namespace outcore::tools {
namespace {

TEST(BlasKernels, AFallbackIsReplacedByTheWidestVectorsTheCpuRuns) {
  const CpuVectorFeatures avx512{.avx512 = true, .avx2_fma = true};
  const CpuVectorFeatures avx2{.avx512 = false, .avx2_fma = true};
  const CpuVectorFeatures sse{};
  EXPECT_EQ(better_blas_kernels("Prescott", avx512), "SkylakeX");
  EXPECT_EQ(better_blas_kernels("prescott", avx2), "Haswell");
  EXPECT_EQ(better_blas_kernels("Core2", avx512), "SkylakeX");
  EXPECT_EQ(better_blas_kernels("Nehalem", avx2), "Haswell");
  EXPECT_FALSE(better_blas_kernels("Prescott", sse));  // nothing better to run
}

TEST(BlasKernels, RecognisedCpusKeepTheirKernels) {
  const CpuVectorFeatures avx512{.avx512 = true, .avx2_fma = true};
  for (const char* core : {"SkylakeX", "Cooperlake", "SapphireRapids", "Haswell", "Zen"})
    EXPECT_FALSE(better_blas_kernels(core, avx512)) << core;
}

TEST(BlasKernels, ThisProgramRunsTheBestKernelsItsCpuAllows) {
  const std::string name = blas_kernel_name();
  const char* forced = std::getenv("OPENBLAS_CORETYPE");
  const auto better = better_blas_kernels(name, cpu_vector_features());
  if (better && forced != nullptr)
    GTEST_SKIP() << "OPENBLAS_CORETYPE=" << forced << " was set outside; OpenBLAS runs " << name;
  EXPECT_FALSE(better) << "OpenBLAS runs " << name << " where " << *better << " would do";
}

}  // namespace
}  // namespace outcore::tools
