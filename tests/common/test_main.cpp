// The main of every test program: the OpenBLAS kernels that outcore's programs run (so results
// computed here and by an `outcore` child process are the same bits), the compute backend's
// settings as programs take them (tools::apply_compute_settings:
// OUTCORE_CUBLASLT_WORKSPACE_MB), then gtest.
#include <gtest/gtest.h>

#include "tools/blas/blas_kernels.hpp"
#include "tools/env_settings.hpp"

int main(int argc, char** argv) {
  outcore::tools::select_blas_kernels(argv);
  outcore::tools::apply_compute_settings();
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
