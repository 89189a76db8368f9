// NcclComm's construction, on any machine (part of test_comm where NcclComm is built): without
// a usable GPU it throws an outcore::Error naming the CUDA error; bad options and a device
// that does not exist are refused. A LocalComm (world of one) is the bootstrap.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <string>

#include "common/error.hpp"
#include "engine/comm/local_comm.hpp"
#include "engine/comm/nccl_comm.hpp"
#include "tests/common/error_of.hpp"

namespace outcore::comm {
namespace {

using outcore::test::error_of;

TEST(NcclCommSetup, WithoutAUsableGpuConstructionNamesTheCudaError) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  LocalComm bootstrap;
  if (err == cudaSuccess && count > 0) {
    NcclComm c(bootstrap);
    EXPECT_EQ(c.name(), "nccl");
    EXPECT_EQ(c.world_size(), 1);
    EXPECT_EQ(c.device(), 0);
    GTEST_SKIP() << "a GPU is usable here: constructed NcclComm on device 0";
  }
  const std::string msg = error_of<Error>([&] { NcclComm c(bootstrap); });
  EXPECT_NE(msg.find("NcclComm setup: CUDA error"), std::string::npos) << msg;
  EXPECT_NE(msg.find(cudaGetErrorString(err)), std::string::npos) << msg;
  EXPECT_NE(msg.find("cudaGetDeviceCount"), std::string::npos) << msg;
}

TEST(NcclCommSetup, ADeviceThatDoesNotExistIsRefused) {
  LocalComm bootstrap;
  const std::string msg = error_of<Error>([&] { NcclComm c(bootstrap, {.device = 1000}); });
  int count = 0;
  if (cudaGetDeviceCount(&count) == cudaSuccess && count > 0) {
    EXPECT_NE(msg.find("CUDA device 1000 does not exist"), std::string::npos) << msg;
  } else {
    EXPECT_NE(msg.find("CUDA error"), std::string::npos) << msg;
  }
}

TEST(NcclCommSetup, BadOptionsAreInvalidArguments) {
  LocalComm bootstrap;
  EXPECT_THROW(NcclComm(bootstrap, {.max_elems_per_call = 0}), InvalidArgument);
  EXPECT_THROW(NcclComm(bootstrap, {.max_elems_per_call = (size_t{1} << 31) + 1}), InvalidArgument);
  EXPECT_THROW(NcclComm(bootstrap, {.device = -2}), InvalidArgument);
}

}  // namespace
}  // namespace outcore::comm
