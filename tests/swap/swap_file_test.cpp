// SwapSpace: directory layout, preallocation, headers, cleanup on exit and on error, stale
// files, locking, and a plan that does not fit the disk (statvfs and fallocate ENOSPC).
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <fstream>
#include <mutex>
#include <optional>
#include <thread>

#include "aio/file_internal.hpp"
#include "common/cleanup.hpp"
#include "common/lock_file.hpp"
#include "swap/swap.hpp"
#include "swap/swap_file_format.hpp"
#include "tests/common/log_capture.hpp"
#include "tests/swap/test_util.hpp"

namespace outcore::swap {
namespace {

namespace fs = std::filesystem;
using test::TempDir;

std::vector<SwapFileSpec> small_plan() {
  return {
      {.unit = 0, .kind = SwapKind::kParam, .tensors = {{"wq", 10000}, {"wk", 4096}, {"n", 2}}},
      {.unit = 1, .kind = SwapKind::kParam, .tensors = {{"wq", 5}}},
      {.unit = 0, .kind = SwapKind::kGrad, .tensors = {{"g", 123457}}},
      optimizer_file_spec(0, 3000, 1000),
  };
}

std::vector<unsigned char> read_all(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

std::string text_of(const fs::path& p) {
  const std::vector<unsigned char> bytes = read_all(p);
  return {bytes.begin(), bytes.end()};
}

TEST(SwapSpace, LaysOutPreallocatedFilesWithHeaders) {
  TempDir dir;
  auto plan = small_plan();
  SwapSpace space({.nvme_path = dir.path(), .rank = 3}, plan);
  const fs::path root = dir.path() / "outcore_swap" / "rank3";
  EXPECT_EQ(space.root(), root);
  EXPECT_EQ(space.file_path(0, SwapKind::kParam), root / "param" / "0.bin");
  EXPECT_EQ(space.file_path(0, SwapKind::kOptimizer), root / "optimizer" / "0.bin");

  uint64_t total = 0;
  for (const SwapFileSpec& f : plan) {
    fs::path p = space.file_path(f.unit, f.kind);
    ASSERT_TRUE(fs::exists(p)) << p;
    uint64_t expect = 4096;
    for (const auto& t : f.tensors) expect += align_up(t.bytes, 4096);
    EXPECT_EQ(fs::file_size(p), expect) << p;
    struct stat st {};
    ASSERT_EQ(::stat(p.c_str(), &st), 0);
    EXPECT_GE(uint64_t(st.st_blocks) * 512, expect) << "not preallocated: " << p;
    total += expect;

    auto bytes = read_all(p);
    ASSERT_GE(bytes.size(), 4096u);
    EXPECT_EQ(std::memcmp(bytes.data(), format::kMagic, 8), 0);
    uint32_t version, kind, unit, count;
    std::memcpy(&version, &bytes[8], 4);
    std::memcpy(&kind, &bytes[12], 4);
    std::memcpy(&unit, &bytes[16], 4);
    std::memcpy(&count, &bytes[20], 4);
    EXPECT_EQ(version, format::kVersion);
    EXPECT_EQ(kind, static_cast<uint32_t>(f.kind));
    EXPECT_EQ(unit, f.unit);
    ASSERT_EQ(count, f.tensors.size());
    for (uint32_t i = 0; i < count; ++i) {
      const unsigned char* e = &bytes[64 + 64 * i];
      EXPECT_EQ(std::string(reinterpret_cast<const char*>(e)), f.tensors[i].name);
      uint64_t off, len;
      std::memcpy(&off, e + 48, 8);
      std::memcpy(&len, e + 56, 8);
      TensorId id = space.find(f.unit, f.kind, f.tensors[i].name);
      EXPECT_EQ(id.index, i);
      EXPECT_EQ(off, space.info(id).offset);
      EXPECT_EQ(off % 4096, 0u);
      EXPECT_GE(off, 4096u);
      EXPECT_EQ(len, f.tensors[i].bytes);
    }
  }
  EXPECT_EQ(space.total_bytes(), total);
  EXPECT_EQ(SwapSpace::bytes_needed(plan), total);
  EXPECT_EQ(space.tensor_count(0, SwapKind::kParam), 3u);
  EXPECT_EQ(space.tensor_count(9, SwapKind::kParam), 0u);
  EXPECT_THROW(space.find(0, SwapKind::kParam, "nope"), InvalidArgument);
  EXPECT_THROW(space.info({.unit = 0, .kind = SwapKind::kParam, .index = 3}), InvalidArgument);
}

TEST(SwapSpace, HeaderGrowsPastOneBlockForManyTensors) {
  TempDir dir;
  SwapFileSpec f = optimizer_file_spec(7, 200 * 10, 10);  // 200 tensors
  SwapSpace space({.nvme_path = dir.path()}, std::span(&f, 1));
  uint64_t header = align_up(64 + 64 * 200, 4096);
  EXPECT_EQ(space.info({7, SwapKind::kOptimizer, 0}).offset, header);
  // A 10-element sub-group takes three 4 KiB parts (master, exp_avg, exp_avg_sq).
  EXPECT_EQ(space.info({7, SwapKind::kOptimizer, 1}).offset, header + 4096 * 3);
  EXPECT_EQ(space.info({7, SwapKind::kOptimizer, 199}).offset, header + 4096 * 3 * 199);
}

// What the free-space checks add for the tree besides its files covers the blocks its
// directories (one of thousands of entries among them) and lock files take.
TEST(SwapSpace, TheTreesDirectoriesAndLocksTakeAtMostTreeBytesNeeded) {
  TempDir dir;
  std::vector<SwapFileSpec> plan = small_plan();
  for (uint32_t u = 2; u < 3000; ++u)
    plan.push_back({.unit = u, .kind = SwapKind::kParam, .tensors = {{"w", 1}}});
  SwapSpace space({.nvme_path = dir.path()}, plan);
  uint64_t taken = 0, lock_files = 0;
  for (const fs::directory_entry& e :
       fs::recursive_directory_iterator(dir.path() / "outcore_swap")) {
    if (e.path().extension() == ".bin") continue;
    struct stat st {};
    ASSERT_EQ(::stat(e.path().c_str(), &st), 0) << e.path();
    taken += static_cast<uint64_t>(st.st_blocks) * 512;
    lock_files += e.path().filename() == ".lock";
  }
  struct stat top {};
  ASSERT_EQ(::stat((dir.path() / "outcore_swap").c_str(), &top), 0);
  taken += static_cast<uint64_t>(top.st_blocks) * 512;
  EXPECT_EQ(lock_files, 3u);  // param, grad, optimizer
  EXPECT_GT(taken, 3u * 4096) << "the filesystem counts no blocks for directories";
  EXPECT_LE(taken, SwapSpace::tree_bytes_needed(plan));
}

TEST(SwapSpace, RemovesItsFilesAndDirectoriesOnDestruction) {
  TempDir dir;
  { SwapSpace space({.nvme_path = dir.path()}, small_plan()); }
  EXPECT_FALSE(fs::exists(dir.path() / "outcore_swap"));
}

// A file put at a swap file's name while the run worked (a user's output renamed over it) is
// not the run's: neither its end nor a removal of the registered files takes it.
TEST(SwapSpace, AFilePutAtASwapFilesNameIsLeft) {
  TempDir dir;
  for (const bool by_registry : {false, true}) {
    SCOPED_TRACE(by_registry ? "the registered files' removal" : "the destructor");
    std::optional<SwapSpace> space;
    space.emplace(SwapSpaceOptions{.nvme_path = dir.path()}, small_plan());
    const fs::path replaced = space->file_path(0, SwapKind::kGrad);
    const fs::path other = space->file_path(1, SwapKind::kParam);
    const fs::path staged = dir.path() / "users.tmp";
    std::ofstream(staged) << "a user's output";
    fs::rename(staged, replaced);
    outcore::test::LogCapture log;
    if (by_registry) {
      EXPECT_GE(cleanup::remove_registered_files(cleanup::Scope::kData), 1u);
    }
    EXPECT_FALSE(by_registry && fs::exists(other)) << "the run's own files go";
    space.reset();
    if (!by_registry) {
      EXPECT_NE(log.text().find("is no longer this run's swap file"), std::string::npos)
          << log.text();
    }
    EXPECT_EQ(text_of(replaced), "a user's output");
    EXPECT_FALSE(fs::exists(other));
    fs::remove_all(dir.path() / "outcore_swap");
  }
}

TEST(SwapSpace, RemovesItsFilesWhenAnErrorUnwinds) {
  TempDir dir;
  try {
    SwapSpace space({.nvme_path = dir.path()}, small_plan());
    ASSERT_TRUE(fs::exists(space.file_path(0, SwapKind::kGrad)));
    throw IoError("somewhere", EIO, "a later failure");
  } catch (const IoError&) {
  }
  EXPECT_FALSE(fs::exists(dir.path() / "outcore_swap"));
}

TEST(SwapSpace, ClearsStaleFilesOfAnEarlierRun) {
  TempDir dir;
  fs::path kind_dir = dir.path() / "outcore_swap" / "rank0" / "param";
  fs::create_directories(kind_dir);
  {
    // A swap file an earlier run left (killed before its clean-up), and one it left before its
    // header was written (empty: the header goes in before the preallocation).
    TempDir other;
    SwapFileSpec g{.unit = 42, .kind = SwapKind::kParam, .tensors = {{"w", 8}}};
    SwapSpace earlier({.nvme_path = other.path()}, std::span(&g, 1));
    fs::copy_file(earlier.file_path(42, SwapKind::kParam), kind_dir / "42.bin");
  }
  std::ofstream(kind_dir / "43.bin");
  // Files with a swap file's name that are not swap files: a user's data (zeros too).
  std::ofstream(kind_dir / "44.bin") << std::string(8192, '\0') << "tokens after a zero block";
  std::ofstream(kind_dir / "45.bin") << "the user's tokens";
  std::ofstream(kind_dir / "46.bin") << std::string(100, '\0') << "tokens after zeros";
  std::ofstream(kind_dir / "notes.txt") << "not ours";
  std::ofstream(kind_dir / "model.bin") << "not ours either";  // not a name outcore makes
  fs::create_directories(dir.path() / "mine");
  std::ofstream(dir.path() / "mine" / "7.bin") << "mine";
  fs::create_symlink(dir.path() / "mine" / "7.bin", kind_dir / "7.bin");
  SwapFileSpec f{.unit = 0, .kind = SwapKind::kParam, .tensors = {{"w", 8}}};
  {
    SwapSpace space({.nvme_path = dir.path()}, std::span(&f, 1));
    EXPECT_FALSE(fs::exists(kind_dir / "42.bin"));
    EXPECT_FALSE(fs::exists(kind_dir / "43.bin"));
    EXPECT_TRUE(fs::exists(kind_dir / "44.bin"));
    EXPECT_TRUE(fs::exists(kind_dir / "45.bin"));
    EXPECT_TRUE(fs::exists(kind_dir / "46.bin"));
    EXPECT_TRUE(fs::exists(kind_dir / "notes.txt"));
    EXPECT_TRUE(fs::exists(kind_dir / "model.bin"));
    EXPECT_TRUE(fs::is_symlink(kind_dir / "7.bin"));
  }
  EXPECT_TRUE(fs::exists(kind_dir / "notes.txt"));  // only our files are removed
  EXPECT_TRUE(fs::exists(kind_dir / "model.bin"));
  EXPECT_TRUE(fs::exists(dir.path() / "mine" / "7.bin"));
  EXPECT_FALSE(fs::exists(kind_dir / "0.bin"));
  EXPECT_EQ(text_of(kind_dir / "45.bin"), "the user's tokens");
  // A user's file where a swap file must go stops the run, naming it, and stays: one that
  // begins with a block of zeros too.
  for (const std::string& users :
       {std::string("the user's tokens"), std::string(8192, '\0') + "tokens after zeros"}) {
    std::ofstream(kind_dir / "0.bin") << users;
    try {
      SwapSpace space({.nvme_path = dir.path()}, std::span(&f, 1));
      ADD_FAILURE() << "a user's file was taken for a swap file";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("0.bin: exists and is not an outcore swap file"),
                std::string::npos)
          << e.what();
    }
    EXPECT_EQ(text_of(kind_dir / "0.bin"), users);
  }
  EXPECT_EQ(text_of(kind_dir / "45.bin"), "the user's tokens");
}

// A swap file an earlier run left: unit `unit`'s, in `kind_dir`.
void leave_swap_file(const fs::path& kind_dir, uint32_t unit) {
  TempDir other;
  SwapFileSpec g{.unit = unit, .kind = SwapKind::kParam, .tensors = {{"w", 8}}};
  SwapSpace earlier({.nvme_path = other.path()}, std::span(&g, 1));
  fs::create_directories(kind_dir);
  fs::copy_file(earlier.file_path(unit, SwapKind::kParam),
                kind_dir / (std::to_string(unit) + ".bin"));
}

// A run killed at world size 2 and resumed at 1: rank 0 of the smaller world removes the swap
// files rank 1 left, and its directories; a rank beyond the world that a live run holds, and a
// user's file there, are left. Without world_size, other ranks are not looked at.
TEST(SwapSpace, RankZeroClearsTheStaleFilesOfRanksBeyondTheWorld) {
  TempDir dir;
  const fs::path top = dir.path() / "outcore_swap";
  leave_swap_file(top / "rank1" / "param", 3);
  leave_swap_file(top / "rank1" / "optimizer", 4);
  leave_swap_file(top / "rank2" / "grad", 5);
  std::ofstream(top / "rank2" / "grad" / "notes.txt") << "the user's";
  SwapFileSpec f{.unit = 0, .kind = SwapKind::kParam, .tensors = {{"w", 8}}};
  {
    SwapSpace unaware({.nvme_path = dir.path()}, std::span(&f, 1));
    EXPECT_TRUE(fs::exists(top / "rank1" / "param" / "3.bin"));
  }
  // A live run's rank 3 holds its directory.
  SwapSpace live({.nvme_path = dir.path(), .rank = 3}, std::span(&f, 1));
  {
    SwapSpace space({.nvme_path = dir.path(), .world_size = 1}, std::span(&f, 1));
    EXPECT_FALSE(fs::exists(top / "rank1"));
    EXPECT_FALSE(fs::exists(top / "rank2" / "grad" / "5.bin"));
    EXPECT_EQ(text_of(top / "rank2" / "grad" / "notes.txt"), "the user's");
    EXPECT_TRUE(fs::exists(live.file_path(0, SwapKind::kParam)));
  }
  // Rank 1 of a world of 2 is not rank 0's to clear.
  leave_swap_file(top / "rank1" / "param", 3);
  { SwapSpace space({.nvme_path = dir.path(), .world_size = 2}, std::span(&f, 1)); }
  EXPECT_TRUE(fs::exists(top / "rank1" / "param" / "3.bin"));
}

// A run that keeps a kind elsewhere now (gradients in host memory, after a run that kept them in
// swap files) removes that kind's stale files too, and its directory once empty; a user's file
// there stays, and a kind directory a live swap space holds is left alone.
TEST(SwapSpace, ClearsTheStaleFilesOfKindsItDoesNotUse) {
  TempDir dir;
  const fs::path rank0 = dir.path() / "outcore_swap" / "rank0";
  leave_swap_file(rank0 / "grad", 5);
  leave_swap_file(rank0 / "optimizer", 4);
  std::ofstream(rank0 / "optimizer" / "notes.txt") << "the user's";
  SwapFileSpec p{.unit = 0, .kind = SwapKind::kParam, .tensors = {{"w", 8}}};
  {
    SwapSpace space({.nvme_path = dir.path()}, std::span(&p, 1));
    EXPECT_FALSE(fs::exists(rank0 / "grad"));
    EXPECT_FALSE(fs::exists(rank0 / "optimizer" / "4.bin"));
    EXPECT_EQ(text_of(rank0 / "optimizer" / "notes.txt"), "the user's");
  }
  // This process's other swap space holds grad/: its files are in use.
  SwapFileSpec g{.unit = 7, .kind = SwapKind::kGrad, .tensors = {{"g", 8}}};
  SwapSpace grads({.nvme_path = dir.path()}, std::span(&g, 1));
  { SwapSpace space({.nvme_path = dir.path()}, std::span(&p, 1)); }
  EXPECT_TRUE(fs::exists(grads.file_path(7, SwapKind::kGrad)));
}

// A user's file at a swap directory's lock name is locked, never written or removed; the swap
// space's own lock file goes with it.
TEST(SwapSpace, KeepsAUsersFileAtTheLockName) {
  TempDir dir;
  const fs::path kind_dir = dir.path() / "outcore_swap" / "rank0" / "param";
  fs::create_directories(kind_dir);
  std::ofstream(kind_dir / ".lock") << "the user's notes";
  SwapFileSpec f{.unit = 0, .kind = SwapKind::kParam, .tensors = {{"w", 8}}};
  { SwapSpace space({.nvme_path = dir.path()}, std::span(&f, 1)); }
  EXPECT_EQ(text_of(kind_dir / ".lock"), "the user's notes");
  EXPECT_FALSE(fs::exists(kind_dir / "0.bin"));
  fs::remove(kind_dir / ".lock");
  { SwapSpace space({.nvme_path = dir.path()}, std::span(&f, 1)); }
  EXPECT_FALSE(fs::exists(dir.path() / "outcore_swap"));  // its own lock went, then the tree
}

// A file of the user's where a swap directory goes is bad input, refused naming it
// (InvalidArgument: exit 2 from outcore train), and kept.
TEST(SwapSpace, AFileWhereItsDirectoryGoesIsRefusedAndKept) {
  TempDir dir;
  std::ofstream(dir.path() / "outcore_swap") << "the user's file";
  SwapFileSpec f{.unit = 0, .kind = SwapKind::kParam, .tensors = {{"w", 8}}};
  try {
    SwapSpace space({.nvme_path = dir.path()}, std::span(&f, 1));
    ADD_FAILURE() << "a file at outcore_swap was taken";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("outcore_swap: exists and is not a directory"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(text_of(dir.path() / "outcore_swap"), "the user's file");
}

TEST(SwapSpace, SameRankAndKindCannotBeUsedTwice) {
  TempDir dir;
  SwapFileSpec p{.unit = 0, .kind = SwapKind::kParam, .tensors = {{"w", 8}}};
  SwapFileSpec o = optimizer_file_spec(0, 10, 10);
  SwapSpace a({.nvme_path = dir.path()}, std::span(&p, 1));
  EXPECT_THROW(SwapSpace({.nvme_path = dir.path()}, std::span(&p, 1)), IoError);
  EXPECT_TRUE(fs::exists(a.file_path(0, SwapKind::kParam)));  // the failed one left it alone
  SwapSpace other_kind({.nvme_path = dir.path()}, std::span(&o, 1));
  SwapSpace other_rank({.nvme_path = dir.path(), .rank = 1}, std::span(&p, 1));
}

// The holder unlinks its lock file before closing it. A taker that opened the old file, and
// wins the flock after the holder let go and a third run locked a new file, must not believe it
// holds the directory too (it would delete the third run's swap files as stale).
TEST(SwapSpace, LockTakenOnAReleasedFileIsRetriedNotShared) {
  TempDir dir;
  SwapFileSpec p{.unit = 0, .kind = SwapKind::kParam, .tensors = {{"w", 8}}};
  auto a = std::make_unique<SwapSpace>(SwapSpaceOptions{.nvme_path = dir.path()}, std::span(&p, 1));
  std::unique_ptr<SwapSpace> c;
  outcore::internal::set_lock_open_hook([&] {
    a.reset();  // releases: unlinks .lock, closes
    c = std::make_unique<SwapSpace>(SwapSpaceOptions{.nvme_path = dir.path()}, std::span(&p, 1));
  });
  EXPECT_THROW(SwapSpace({.nvme_path = dir.path()}, std::span(&p, 1)), IoError);
  ASSERT_TRUE(c);
  EXPECT_TRUE(fs::exists(c->file_path(0, SwapKind::kParam)));  // not deleted as stale
}

// Ranks coming and going on one nvme_path: each removes the directories it leaves empty
// (outcore_swap/ itself when it is the last), which another rank may have just created for
// itself; that rank creates them again instead of failing.
TEST(SwapSpace, RanksComingAndGoingOnOneNvmePathNeverFail) {
  TempDir dir;
  SwapFileSpec p{.unit = 0, .kind = SwapKind::kParam, .tensors = {{"w", 8}}};
  std::atomic<int> failures{0};
  std::string first_failure;
  std::mutex mu;
  auto churn = [&](int rank) {
    for (int i = 0; i < 400; ++i) {
      try {
        SwapSpace space({.nvme_path = dir.path(), .rank = rank}, std::span(&p, 1));
      } catch (const std::exception& e) {
        if (failures++ == 0) {
          std::lock_guard lock(mu);
          first_failure = e.what();
        }
      }
    }
  };
  std::thread a(churn, 0), b(churn, 1);
  a.join();
  b.join();
  EXPECT_EQ(failures.load(), 0) << first_failure;
  EXPECT_FALSE(fs::exists(dir.path() / "outcore_swap"));
}

TEST(SwapSpace, TwoProcessesCannotHoldOneDirectory) {
  TempDir dir;
  SwapFileSpec p{.unit = 0, .kind = SwapKind::kParam, .tensors = {{"w", 8}}};
  int to_parent[2], to_child[2];
  ASSERT_EQ(pipe(to_parent), 0);
  ASSERT_EQ(pipe(to_child), 0);
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    char c = 0;
    {
      SwapSpace held({.nvme_path = dir.path()}, std::span(&p, 1));
      if (write(to_parent[1], "L", 1) != 1) _exit(3);
      if (read(to_child[0], &c, 1) != 1) _exit(4);
    }
    _exit(0);
  }
  char c = 0;
  ASSERT_EQ(read(to_parent[0], &c, 1), 1);
  EXPECT_THROW(SwapSpace({.nvme_path = dir.path()}, std::span(&p, 1)), IoError);
  ASSERT_EQ(write(to_child[1], "x", 1), 1);
  int status = 0;
  waitpid(pid, &status, 0);
  EXPECT_EQ(WEXITSTATUS(status), 0);
  SwapSpace mine({.nvme_path = dir.path()}, std::span(&p, 1));  // free again
  EXPECT_TRUE(fs::exists(mine.file_path(0, SwapKind::kParam)));
}

TEST(SwapSpace, RejectsMalformedPlans) {
  TempDir dir;
  auto expect_invalid = [&](std::vector<SwapFileSpec> plan) {
    EXPECT_THROW(SwapSpace({.nvme_path = dir.path()}, plan), InvalidArgument);
  };
  expect_invalid({{.unit = 0, .tensors = {{"a", 1}}}, {.unit = 0, .tensors = {{"b", 1}}}});
  expect_invalid({{.unit = 0, .tensors = {{"a", 1}, {"a", 2}}}});
  expect_invalid({{.unit = 0, .tensors = {{"a", 0}}}});
  expect_invalid({{.unit = 0, .tensors = {{"", 1}}}});
  expect_invalid({{.unit = 0, .tensors = {{std::string(48, 'x'), 1}}}});
  expect_invalid({{.unit = 0, .tensors = {}}});
  EXPECT_THROW(optimizer_file_spec(0, 0, 10), InvalidArgument);
  EXPECT_THROW(SwapSpace({.nvme_path = dir.path() / "missing"}, small_plan()), IoError);
  EXPECT_FALSE(fs::exists(dir.path() / "outcore_swap"));
}

TEST(SwapSpace, PlanLargerThanTheFreeSpaceFailsBeforeWritingAnything) {
  TempDir dir;
  struct statvfs st {};
  ASSERT_EQ(::statvfs(dir.path().c_str(), &st), 0);
  const uint64_t free_bytes = uint64_t(st.f_bavail) * st.f_frsize;
  // More than is free; nothing is ever written, so this costs no disk.
  std::vector<SwapFileSpec> plan = small_plan();
  plan.push_back(
      {.unit = 5, .kind = SwapKind::kGrad, .tensors = {{"huge", free_bytes + (1ull << 30)}}});
  try {
    SwapSpace space({.nvme_path = dir.path()}, plan);
    FAIL() << "expected IoError(ENOSPC)";
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_number(), ENOSPC);
    std::string msg = e.what();
    EXPECT_NE(msg.find(std::to_string(SwapSpace::bytes_needed(plan)) + " bytes needed"),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find("bytes free"), std::string::npos) << msg;
    EXPECT_NE(msg.find("rank0"), std::string::npos) << msg;
  }
  EXPECT_FALSE(fs::exists(dir.path() / "outcore_swap"));
}

int g_fallocate_calls = 0;
int fallocate_enospc_on_third(int fd, int mode, off_t offset, off_t len) {
  if (++g_fallocate_calls >= 3) {
    errno = ENOSPC;
    return -1;
  }
  return ::fallocate(fd, mode, offset, len);
}

TEST(SwapSpace, FallocateEnospcFailsWithNeededAndFreeAndCleansUp) {
  TempDir dir;
  g_fallocate_calls = 0;
  auto prev = aio::internal::set_fallocate_function_for_testing(&fallocate_enospc_on_third);
  std::string msg;
  try {
    SwapSpace space({.nvme_path = dir.path()}, small_plan());
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_number(), ENOSPC);
    msg = e.what();
  }
  aio::internal::set_fallocate_function_for_testing(prev);
  ASSERT_FALSE(msg.empty()) << "expected IoError(ENOSPC)";
  EXPECT_NE(msg.find("bytes needed"), std::string::npos) << msg;
  EXPECT_NE(msg.find("bytes free"), std::string::npos) << msg;
  EXPECT_NE(msg.find("grad/0.bin"), std::string::npos) << msg;  // the third file
  EXPECT_FALSE(fs::exists(dir.path() / "outcore_swap"));
}

}  // namespace
}  // namespace outcore::swap
