// same_file: one answer for every check that an output would overwrite an input; path_within:
// one answer for every check that an output lies inside a directory outcore writes.
#include "common/open_file.hpp"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "common/error.hpp"
#include "common/lock_file.hpp"
#include "tests/common/error_of.hpp"
#include "tests/common/temp_dir.hpp"

namespace outcore {
namespace {

namespace fs = std::filesystem;

// A trace's lock: a second holder of the file (through a link too) is refused naming it; the
// empty file a lock created goes with it, a file that was there stays as it was.
TEST(OutputLock, OneHolderAtATimeAndNothingLeftBehind) {
  test::TempDir dir("output-lock");
  const fs::path trace = dir / "trace.json";
  fs::create_symlink(trace, dir / "link.json");
  {
    const OutputLock held(trace.string(), "trace file");
    EXPECT_TRUE(fs::is_regular_file(trace));
    for (const fs::path& p : {trace, dir / "link.json"}) {
      const std::string what = test::error_of([&] { OutputLock second(p.string(), "trace file"); });
      EXPECT_NE(what.find("lock trace file (another run writes it at its end"), std::string::npos)
          << what;
      EXPECT_NE(what.find("failed on " + p.string() + ":"), std::string::npos) << what;
    }
  }
  EXPECT_FALSE(fs::exists(trace));  // created empty, never written: removed
  std::ofstream(trace) << "{\"traceEvents\": []}";
  {
    const OutputLock held((dir / "link.json").string(), "trace file");
    EXPECT_THROW(OutputLock(trace.string(), "trace file"), PathBusy);
  }
  EXPECT_EQ(fs::file_size(trace), 19u);  // the earlier trace stays until a run replaces it
  const OutputLock again(trace.string(), "trace file");
}

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

// The pid of a process that ran and ended (reaped): no process has it for a while.
pid_t a_dead_pid() {
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ::waitpid(child, nullptr, 0);
  return child;
}

// Temporaries of killed writers go; a running process's, a link, a file of other content or
// another name, and a hard-linked one stay.
TEST(KilledTemporaries, OnlyThoseOfEndedWritersWithTheirContentAreRemoved) {
  test::TempDir dir("killed-temporaries");
  const std::string target = (dir / "trace.json").string();
  const std::string dead = std::to_string(a_dead_pid());
  const std::string alive = std::to_string(::getppid());
  auto put = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir / name) << text;
  };
  put("trace.json.tmp-" + dead, "{\"traceEvents\": [");
  put("trace.json.tmp-" + dead + "-2", "");  // killed before its first byte
  put("trace.json.tmp-" + alive, "{\"traceEvents\": [");
  put("trace.json.tmp-" + dead + "-x", "{\"traceEvents\": [");
  put("trace.jsonl.tmp-" + dead, "{\"traceEvents\": [");
  put("notes.txt", "mine");
  fs::create_hard_link(dir / "notes.txt", dir / ("trace.json.tmp-" + dead + "-3"));
  put("users", "{\"traceEvents\": [");
  fs::create_symlink(dir / "users", dir / ("trace.json.tmp-" + dead + "-4"));
  put("trace.json.tmp-" + dead + "-5", "not a trace");
  remove_killed_temporaries(target, "trace",
                            [](int fd) { return empty_or_begins_with(fd, "{\"traceEvents\""); });
  EXPECT_FALSE(fs::exists(dir / ("trace.json.tmp-" + dead)));
  EXPECT_FALSE(fs::exists(dir / ("trace.json.tmp-" + dead + "-2")));
  for (const std::string& kept :
       {"trace.json.tmp-" + alive, "trace.json.tmp-" + dead + "-x", "trace.jsonl.tmp-" + dead,
        "trace.json.tmp-" + dead + "-3", "trace.json.tmp-" + dead + "-5", std::string("users"),
        std::string("notes.txt")})
    EXPECT_TRUE(fs::exists(dir / kept)) << kept;
  EXPECT_TRUE(fs::is_symlink(dir / ("trace.json.tmp-" + dead + "-4")));
}

TEST(PathWithin, SaysWherePathsLieThroughLinksSpellingsAndNamesNotMadeYet) {
  test::TempDir dir("path-within");
  const fs::path d = dir / "d";
  fs::create_directories(d / "sub");
  fs::create_directory_symlink(d, dir / "d-link");
  const std::string ds = d.string();

  EXPECT_EQ(path_within(ds, ds), ".");
  EXPECT_EQ(path_within(ds + "/", ds), ".");
  EXPECT_EQ(path_within(ds + "/.", ds), ".");
  EXPECT_EQ(path_within((d / "sub" / "f").string(), ds), "sub/f");
  EXPECT_EQ(path_within((d / "new" / "deeper").string(), ds), "new/deeper");  // not made yet
  EXPECT_EQ(path_within((dir / "d-link" / "sub").string(), ds), "sub");       // a linked directory
  EXPECT_EQ(path_within((d / "sub").string(), (dir / "d-link").string()), "sub");
  EXPECT_EQ(path_within((d / "sub" / ".." / "x").string(), ds), "x");
  // Outside: beside it, above it, a name that only starts alike, "..".
  EXPECT_EQ(path_within((dir / "other").string(), ds), "");
  EXPECT_EQ(path_within(dir.path().string(), ds), "");
  EXPECT_EQ(path_within(ds + "x/f", ds), "");
  EXPECT_EQ(path_within((d / ".." / "f").string(), ds), "");
  // Relative paths are taken from the working directory.
  const fs::path cwd = fs::current_path();
  fs::current_path(d);
  EXPECT_EQ(path_within("sub/f", ds), "sub/f");
  EXPECT_EQ(path_within("../f", ds), "");
  fs::current_path(cwd);
  EXPECT_EQ(resolved_path(ds + "/sub/."), (d / "sub").string());
}

}  // namespace
}  // namespace outcore
