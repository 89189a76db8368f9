// The main of every test program: the OpenBLAS kernels that outcore's programs run (so results
// computed here and by an `outcore` child process are the same bits), the fused attention's
// implementation and cuBLASLt's workspace as programs take them (OUTCORE_FLASH_KERNELS and
// OUTCORE_CUBLASLT_WORKSPACE_MB, so `./dev.sh gpu` runs the GPU tests with either), then gtest.
#include <gtest/gtest.h>

#include <cstdlib>

#include "engine/device/compute_backend.hpp"
#include "tools/blas/blas_kernels.hpp"

int main(int argc, char** argv) {
  outcore::tools::select_blas_kernels(argv);
  if (const char* kernels = std::getenv("OUTCORE_FLASH_KERNELS"))
    outcore::device::request_flash_kernels(kernels, "OUTCORE_FLASH_KERNELS");
  if (const char* mib = std::getenv("OUTCORE_CUBLASLT_WORKSPACE_MB"))
    outcore::device::request_gemm_workspace(mib, "OUTCORE_CUBLASLT_WORKSPACE_MB");
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
