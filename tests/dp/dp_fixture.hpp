// The data-parallel tests' fixture: dp_worker (and the outcore CLI) under mpirun at several
// world sizes on one demo dataset, and the comparison of their results with world 1.
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>
#include <utility>

#include "engine/train/demo_data.hpp"
#include "tests/common/run_command.hpp"
#include "tests/train/temp_dir.hpp"

namespace outcore::train::testing {

namespace fs = std::filesystem;

using outcore::testing::run_command;

inline std::string mpirun(int np) {
  return fmt::format("timeout 300 mpirun --allow-run-as-root --oversubscribe --bind-to none -np {}",
                     np);
}

inline std::string read_all(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

inline int count_bin_files(const fs::path& dir) {
  // A rank may remove a directory while this walks it: the walk is taken again then.
  for (int attempt = 0;; ++attempt) {
    int n = 0;
    std::error_code ec;
    if (!fs::exists(dir, ec)) return 0;
    for (fs::recursive_directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec))
      if (it->path().extension() == ".bin" && it->is_regular_file(ec)) ++n;
    if (!ec || attempt == 100) return n;
  }
}

class DataParallel;
struct DataParallelFiles {
  static std::string train();
};

class DataParallel : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    DemoDataOptions o;
    o.train_tokens = 256u << 10;
    o.val_tokens = 32u << 10;
    files_ = new DemoDatasetFiles(write_demo_dataset(dir_->file("data"), o));
    // Loss masks, prompt/completion-like: of every 40 tokens the first 25 are not trained on.
    for (const auto& [tokens, mask] :
         {std::pair{files_->train, train_mask()}, std::pair{files_->val, val_mask()}}) {
      std::string bytes(fs::file_size(tokens) - 1024, '\0');  // llm.c: 1024-byte header, u16
      bytes.resize(bytes.size() / 2);
      for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = i % 40 >= 25 ? 1 : 0;
      std::ofstream(mask, std::ios::binary) << bytes;
    }
    std::string probe;
    have_mpirun_ = run_command("command -v mpirun", probe) == 0;
  }
  static void TearDownTestSuite() {
    delete files_;
    delete dir_;
  }

  // Runs dp_worker at world `np` (1: without mpirun) and returns its result file's bytes.
  std::string train(const std::string& name, int np, int gas, int steps = 10,
                    const std::string& extra = "") {
    const std::string tag = fmt::format(
        "{}_w{}_g{}{}", name, np, gas,
        extra.empty() ? "" : fmt::format("_x{}", std::hash<std::string>{}(extra) % 100000));
    const std::string swap = dir_->file("swap_" + tag), out = dir_->file(tag + ".bin");
    fs::create_directories(swap);
    const std::string cmd =
        fmt::format("{} {} --case {} --gas {} --steps {} --train {} --val {} --swap {} --out {} {}",
                    np > 1 ? mpirun(np) : std::string("timeout 300"), OUTCORE_DP_WORKER, name, gas,
                    steps, files_->train, files_->val, swap, out, extra);
    std::string output;
    const int rc = run_command(cmd, output);
    if (np > 1 &&
        output.find(fmt::format("rank {} of {} started", np - 1, np)) == std::string::npos)
      ADD_FAILURE() << "mpirun could not start " << np << " ranks (rc " << rc << "):\n" << output;
    EXPECT_EQ(rc, 0) << cmd << "\n" << output;
    EXPECT_EQ(count_bin_files(swap), 0) << "swap files left under " << swap;
    return read_all(out);
  }

  static std::string train_mask() { return dir_->file("train.mask"); }
  static std::string val_mask() { return dir_->file("val.mask"); }
  static std::string mask_args() {
    return fmt::format("--mask {} --val-mask {}", train_mask(), val_mask());
  }

  // World `world` x gas `gas` against world 1 x gas world*gas (on the host-accessible device);
  // `extra`: more dp_worker arguments for the many-rank run; `both`: for both runs.
  void expect_same(const std::string& name, int world, int gas, const std::string& extra = "",
                   const std::string& both = "") {
    if (!have_mpirun_) GTEST_SKIP() << "mpirun not found";
    const std::string one = train(name, 1, world * gas, 10, both);
    const std::string many = train(name, world, gas, 10, both.empty() ? extra : extra + " " + both);
    ASSERT_GT(one.size(), 10 * 2 * sizeof(double));
    EXPECT_EQ(one.size(), many.size());
    EXPECT_TRUE(one == many) << name << ": world " << world << " x gas " << gas
                             << " differs from world 1 x gas " << world * gas;
  }

  // A checkpoint saved by `from_world` ranks after `at` of 10 steps, resumed by `to_world`
  // ranks with the same global batch: the resumed steps, validation and weights equal the
  // uninterrupted run's.
  void expect_resume_across_worlds(const std::string& name, int from_world, int to_world,
                                   int micro_batches, int at) {
    if (!have_mpirun_) GTEST_SKIP() << "mpirun not found";
    const std::string save = dir_->file(fmt::format("ckpt_{}_{}_{}", name, from_world, to_world));
    const std::string whole = train(name, from_world, micro_batches / from_world, 10,
                                    fmt::format("--save-dir {} --save-every {}", save, at));
    ASSERT_TRUE(fs::exists(fs::path(save) / fmt::format("global_step{}", at) / "manifest.json"));
    for (int r = 0; r < from_world; ++r)
      EXPECT_TRUE(fs::exists(fs::path(save) / fmt::format("global_step{}", at) /
                             fmt::format("rank{}", r) / "optimizer.bin"));
    const std::string resumed = train(name, to_world, micro_batches / to_world, 10,
                                      fmt::format("--resume {}/global_step{}", save, at));
    const size_t skip = static_cast<size_t>(at) * 2 * sizeof(double);
    ASSERT_GT(whole.size(), skip);
    EXPECT_TRUE(whole.substr(skip) == resumed)
        << name << ": resumed at world " << to_world << " from world " << from_world
        << " differs from the uninterrupted run";
  }

  static inline TempDir* dir_ = nullptr;
  static inline DemoDatasetFiles* files_ = nullptr;
  static inline bool have_mpirun_ = false;

 public:
  static std::string train_file() { return files_->train; }
};

inline std::string DataParallelFiles::train() { return DataParallel::train_file(); }

}  // namespace outcore::train::testing
