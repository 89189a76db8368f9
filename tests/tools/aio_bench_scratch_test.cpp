// aio_bench's benchmark file: removed when the run ends, unless a file was moved to its name
// since (a user's, kept).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "tests/common/temp_dir.hpp"
#include "tools/aio_bench/scratch.hpp"

namespace outcore::aio_bench {
namespace {

namespace fs = std::filesystem;

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

TEST(AioBenchScratch, RemovesItsFileButNotOneMovedToItsName) {
  test::TempDir dir("aio-bench-scratch");
  std::string path;
  {
    const ScratchFile f(dir.path(), "aio_bench", 1 << 20);
    path = f.path();
    EXPECT_TRUE(fs::exists(path));
  }
  EXPECT_FALSE(fs::exists(path));
  {
    const ScratchFile f(dir.path(), "aio_bench", 1 << 20);
    path = f.path();
    std::ofstream(dir.path() / "thesis.txt") << "my thesis";
    fs::rename(dir.path() / "thesis.txt", path);  // while the benchmark runs
  }
  EXPECT_EQ(slurp(path), "my thesis");
}

}  // namespace
}  // namespace outcore::aio_bench
