// Data parallelism on a GPU (label gpu): two ranks under mpirun share the machine's first GPU,
// so a GPU's data path of several ranks runs for real (parameters gathered in pinned memory
// and copied up whole, gradient slabs copied down and reduced there, every collective on the
// engine's comm lane, none on CUDA's callback thread: dp_worker refuses one that runs there),
// and must train bit-identically to one rank with the same global batch on the same GPU.
// Skips without a usable GPU or without mpirun.
#include <gtest/gtest.h>

#include "engine/device/device.hpp"
#include "tests/dp/dp_fixture.hpp"

namespace outcore::train::testing {
namespace {

class DataParallelGpu : public DataParallel {
 protected:
  void SetUp() override {
    const device::ProbeResult p = device::probe();
    if (!p.available) GTEST_SKIP() << "no usable GPU: " << p.summary();
  }
};

// Stage 3, bf16 compute, parameters and optimizer state in swap files under a device budget
// below each rank's share of the state: fetches are host gathers.
TEST_F(DataParallelGpu, Stage3NvmeWorld2MatchesWorld1) {
  expect_same("s3_nvme_bf16", 2, 2, "", "--device cuda");
}
// Stage 2 with the optimizer in host memory: publications gathered in pinned memory; clipping
// on, so the norm gathered from both ranks must agree to the bit.
TEST_F(DataParallelGpu, Stage2CpuWorld2MatchesWorld1) {
  expect_same("s2_cpu_bf16", 2, 1, "", "--device cuda");
}

}  // namespace
}  // namespace outcore::train::testing
