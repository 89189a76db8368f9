// same_file: one answer for every check that an output would overwrite an input.
#include "common/open_file.hpp"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "tests/common/temp_dir.hpp"

namespace outcore {
namespace {

namespace fs = std::filesystem;

TEST(SameFile, FollowsLinksAndSpellingsAndComparesFilesNotMadeYetByPath) {
  test::TempDir dir("same-file");
  const fs::path a = dir / "a.bin";
  const fs::path b = dir / "b.bin";
  std::ofstream(a) << "a";
  std::ofstream(b) << "a";  // the same bytes, another file
  fs::create_directory(dir / "sub");
  fs::create_hard_link(a, dir / "hard.bin");
  fs::create_symlink(a, dir / "soft.bin");

  EXPECT_TRUE(same_file(a.string(), a.string()));
  EXPECT_TRUE(same_file(a.string(), (dir / "sub" / ".." / "a.bin").string()));
  EXPECT_TRUE(same_file(a.string(), (dir / "hard.bin").string()));
  EXPECT_TRUE(same_file((dir / "soft.bin").string(), a.string()));
  EXPECT_FALSE(same_file(a.string(), b.string()));

  // Not made yet: the same path, through a linked directory too.
  fs::create_directory_symlink(dir / "sub", dir / "sub-link");
  EXPECT_TRUE(
      same_file((dir / "sub" / "new.bin").string(), (dir / "sub-link" / "new.bin").string()));
  EXPECT_FALSE(same_file((dir / "sub" / "new.bin").string(), (dir / "sub" / "other.bin").string()));
  // One made, one not: never the same.
  EXPECT_FALSE(same_file(a.string(), (dir / "sub" / "new.bin").string()));
  EXPECT_FALSE(same_file("", ""));
  EXPECT_FALSE(same_file(a.string(), ""));
}

}  // namespace
}  // namespace outcore
