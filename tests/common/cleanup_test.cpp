// cleanup: what a rank told to stop removes (swap data) and what only a process ending at once
// removes (locks, staged outputs).
#include "common/cleanup.hpp"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "tests/common/temp_dir.hpp"

namespace outcore::cleanup {
namespace {

namespace fs = std::filesystem;

TEST(Cleanup, AStopRemovesTheDataAndKeepsTheLocksUntilTheProcessEnds) {
  test::TempDir dir("cleanup");
  const fs::path data = dir / "swap.bin", lock = dir / ".lock", sub = dir / "kind";
  std::ofstream(data) << "x";
  std::ofstream(lock) << "";
  fs::create_directory(sub);
  register_path(sub.string(), /*directory=*/true);
  register_path(data.string());
  register_path(lock.string(), false, Scope::kAll);
  const fs::path locked = dir / "locked";  // a directory still holding the lock
  fs::create_directory(locked);
  register_path(locked.string(), /*directory=*/true);
  std::ofstream(locked / ".lock") << "";
  register_path((locked / ".lock").string(), false, Scope::kAll);
  EXPECT_EQ(remove_registered_files(Scope::kData), 1u);
  EXPECT_FALSE(fs::exists(data));
  EXPECT_FALSE(fs::exists(sub)) << "an empty directory of the data goes too";
  EXPECT_TRUE(fs::exists(locked / ".lock"));
  EXPECT_TRUE(fs::exists(lock)) << "a working process keeps its lock";
  EXPECT_EQ(remove_registered_files(Scope::kData), 0u) << "the data is forgotten";
  EXPECT_EQ(remove_registered_files(Scope::kAll), 2u);
  EXPECT_FALSE(fs::exists(lock));
  EXPECT_FALSE(fs::exists(locked)) << "a directory emptied by the wider removal goes then";
  EXPECT_EQ(remove_registered_files(), 0u);
}

// A scratch directory registered as a tree goes whole with the wider removal, not with a stop's;
// one unregistered (renamed into place by its owner) is never touched.
TEST(Cleanup, ATreeGoesWholeWithTheWiderRemovalOnly) {
  test::TempDir dir("cleanup");
  const fs::path scratch = dir / "out.tmp-1", kept = dir / "out.tmp-2";
  for (const fs::path& d : {scratch, kept}) {
    fs::create_directories(d / "sub");
    std::ofstream(d / "a.safetensors") << "x";
    std::ofstream(d / "sub" / "b") << "y";
  }
  register_tree(scratch.string());
  register_tree(kept.string());
  unregister_path(kept.string());
  EXPECT_EQ(remove_registered_files(Scope::kData), 0u);
  EXPECT_TRUE(fs::exists(scratch / "sub" / "b")) << "a stop keeps it: the process still works";
  EXPECT_EQ(remove_registered_files(Scope::kAll), 1u);
  EXPECT_FALSE(fs::exists(scratch));
  EXPECT_TRUE(fs::exists(kept / "sub" / "b"));
  EXPECT_EQ(remove_registered_files(), 0u);
}

}  // namespace
}  // namespace outcore::cleanup
