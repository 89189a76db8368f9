// Data parallelism across processes (mpirun, oversubscribed on a small machine):
// - W ranks with gas G train bit-identically to one rank with gas W*G over the same samples
//   (losses, grad norms, validation, master weights, parameters), for ZeRO stages 0-3 with
//   optimizer and parameters in memory, host memory and NVMe swap files, fp32, bf16, fp16;
// - each rank's Comm sends exactly the bytes the plan predicts (checked inside dp_worker);
// - a rank that fails or is killed ends the job: every rank exits non-zero within a bounded
//   time and the survivors leave no swap files.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <thread>

#include "engine/train/demo_data.hpp"
#include "tests/train/temp_dir.hpp"

namespace outcore::train::testing {
namespace {

namespace fs = std::filesystem;

int run_command(const std::string& cmd, std::string& output) {
  std::unique_ptr<FILE, int (*)(FILE*)> pipe(popen((cmd + " 2>&1").c_str(), "r"), pclose);
  if (!pipe) return -1;
  std::array<char, 4096> buf{};
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), pipe.get())) > 0) output.append(buf.data(), n);
  const int status = pclose(pipe.release());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string mpirun(int np) {
  return fmt::format("timeout 300 mpirun --allow-run-as-root --oversubscribe --bind-to none -np {}",
                     np);
}

std::string read_all(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

int count_bin_files(const fs::path& dir) {
  int n = 0;
  std::error_code ec;
  if (!fs::exists(dir, ec)) return 0;
  for (const auto& e : fs::recursive_directory_iterator(dir, ec))
    if (e.is_regular_file() && e.path().extension() == ".bin") ++n;
  return n;
}

class DataParallel : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    DemoDataOptions o;
    o.train_tokens = 256u << 10;
    o.val_tokens = 32u << 10;
    files_ = new DemoDatasetFiles(write_demo_dataset(dir_->file("data"), o));
    std::string probe;
    have_mpirun_ = run_command("command -v mpirun", probe) == 0;
  }
  static void TearDownTestSuite() {
    delete files_;
    delete dir_;
  }

  // Runs dp_worker at world `np` (1: without mpirun) and returns its result file's bytes.
  std::string train(const std::string& name, int np, int gas, int steps = 10) {
    const std::string tag = fmt::format("{}_w{}_g{}", name, np, gas);
    const std::string swap = dir_->file("swap_" + tag), out = dir_->file(tag + ".bin");
    fs::create_directories(swap);
    const std::string cmd = fmt::format(
        "{} {} --case {} --gas {} --steps {} --train {} --val {} --swap {} --out {}",
        np > 1 ? mpirun(np) : std::string("timeout 300"), OUTCORE_DP_WORKER, name, gas, steps,
        files_->train, files_->val, swap, out);
    std::string output;
    const int rc = run_command(cmd, output);
    if (np > 1 && output.find(fmt::format("rank {} of {} started", np - 1, np)) ==
                      std::string::npos)
      ADD_FAILURE() << "mpirun could not start " << np << " ranks (rc " << rc << "):\n" << output;
    EXPECT_EQ(rc, 0) << cmd << "\n" << output;
    if (std::getenv("OUTCORE_TEST_VERBOSE") != nullptr) std::printf("%s\n%s\n", cmd.c_str(), output.c_str());
    EXPECT_EQ(count_bin_files(swap), 0) << "swap files left under " << swap;
    return read_all(out);
  }

  void expect_same(const std::string& name, int world, int gas) {
    if (!have_mpirun_) GTEST_SKIP() << "mpirun not found";
    const std::string one = train(name, 1, world * gas);
    const std::string many = train(name, world, gas);
    ASSERT_GT(one.size(), 10 * 2 * sizeof(double));
    EXPECT_EQ(one.size(), many.size());
    EXPECT_TRUE(one == many) << name << ": world " << world << " x gas " << gas
                             << " differs from world 1 x gas " << world * gas;
  }

  static TempDir* dir_;
  static DemoDatasetFiles* files_;
  static bool have_mpirun_;
};

TempDir* DataParallel::dir_ = nullptr;
DemoDatasetFiles* DataParallel::files_ = nullptr;
bool DataParallel::have_mpirun_ = false;

TEST_F(DataParallel, Stage1OptimizerNvmeWorld2MatchesWorld1) { expect_same("s1_nvme_fp32", 2, 2); }
TEST_F(DataParallel, Stage2CpuBf16World3MatchesWorld1) { expect_same("s2_cpu_bf16", 3, 1); }
TEST_F(DataParallel, Stage3NvmeWorld2MatchesWorld1) { expect_same("s3_nvme_fp32", 2, 1); }
TEST_F(DataParallel, Stage3NvmeBf16World3MatchesWorld1) { expect_same("s3_nvme_bf16", 3, 2); }
TEST_F(DataParallel, Stage0Fp16WithOverflowWorld2MatchesWorld1) { expect_same("s0_fp16", 2, 1); }

}  // namespace
}  // namespace outcore::train::testing
