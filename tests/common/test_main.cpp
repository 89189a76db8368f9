// The main of every test program: the OpenBLAS kernels that outcore's programs run (so results
// computed here and by an `outcore` child process are the same bits), then gtest.
#include <gtest/gtest.h>

#include "tools/blas/blas_kernels.hpp"

int main(int argc, char** argv) {
  outcore::tools::select_blas_kernels(argv);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
