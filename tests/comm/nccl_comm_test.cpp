// NcclComm under mpirun on GPUs (label gpu): the shared collective checks on device buffers at
// one rank (one GPU) and at two ranks (two GPUs: NCCL refuses two ranks on one device). Each
// test skips, saying why, where NCCL was not built, mpirun is missing or the GPUs are not
// there.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <memory>
#include <string>

#include "tests/common/run_command.hpp"

#ifdef OUTCORE_NCCL_WORKER
#include <cuda_runtime.h>
#endif

namespace outcore::comm {
namespace {

#ifdef OUTCORE_NCCL_WORKER
using outcore::testing::run_command;

// The number of usable GPUs, or the CUDA runtime's reason there are none.
int usable_gpus(std::string& why) {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    why = fmt::format("no usable GPU: {}", cudaGetErrorString(err));
    return 0;
  }
  if (count == 0) why = "no usable GPU: the CUDA runtime reports no device";
  return count;
}
#endif

void run_ranks(int ranks) {
#ifndef OUTCORE_NCCL_WORKER
  GTEST_SKIP() << "built without NcclComm (needs CUDA, NCCL and OpenMPI)";
#else
  std::string why;
  const int gpus = usable_gpus(why);
  if (gpus == 0) GTEST_SKIP() << why;
  if (gpus < ranks)
    GTEST_SKIP() << fmt::format("{} ranks need {} GPUs (NCCL allows one rank per GPU); {} here",
                                ranks, ranks, gpus);
  std::string probe;
  if (run_command("command -v mpirun", probe) != 0) GTEST_SKIP() << "mpirun not found";
  std::string output;
  int rc = run_command(fmt::format("timeout 180 mpirun --allow-run-as-root --oversubscribe "
                                   "-np {} {}",
                                   ranks, OUTCORE_NCCL_WORKER),
                       output);
  bool started = true;
  for (int r = 0; r < ranks; ++r)
    started = started && output.find(fmt::format("nccl_worker: rank {} of {} started", r, ranks)) !=
                             std::string::npos;
  if (!started)
    GTEST_SKIP() << "mpirun could not start " << ranks << " ranks (rc " << rc << "):\n" << output;
  EXPECT_EQ(rc, 0) << output;
  for (int r = 0; r < ranks; ++r)
    EXPECT_NE(output.find(fmt::format("nccl_worker: rank {} passed", r)), std::string::npos)
        << output;
#endif
}

TEST(NcclComm, OneRankUnderMpirun) { run_ranks(1); }

TEST(NcclComm, TwoRanksUnderMpirun) { run_ranks(2); }

}  // namespace
}  // namespace outcore::comm
