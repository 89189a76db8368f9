// common/trace: nothing recorded while off, lane pools never overlap, thread tracks, the I/O
// overlap arithmetic and the JSON file.
#include "common/trace.hpp"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <thread>
#include <vector>

#include "common/error.hpp"
#include "tests/common/temp_dir.hpp"

namespace outcore::trace {
namespace {

TEST(TraceTest, OffRecordsNothing) {
  start();
  stop();
  { OUTCORE_TRACE_SPAN("off", "test", {.bytes = 1}); }
  complete("off", "test", 0);
  name_thread("off thread");
  EXPECT_EQ(event_count(), 0u);
  EXPECT_TRUE(tracks().empty());
}

TEST(TraceTest, SpansRecordArgsOnTheThreadsTrack) {
  start();
  name_thread("main");
  {
    OUTCORE_TRACE_SPAN("outer", "compute", {.unit = 3});
    OUTCORE_TRACE_SPAN("inner", "io", {.bytes = 4096, .index = 2, .file = "/x/y.bin"});
  }
  std::thread([] {
    name_thread("other");
    OUTCORE_TRACE_SPAN("there", "wait");
  }).join();
  stop();
  const std::vector<Event> ev = events();
  ASSERT_EQ(ev.size(), 3u);
  EXPECT_STREQ(ev[0].name, "inner");  // recorded when it ends
  EXPECT_EQ(ev[0].bytes, 4096);
  EXPECT_EQ(ev[0].index, 2);
  EXPECT_EQ(ev[0].file, "/x/y.bin");
  EXPECT_STREQ(ev[1].name, "outer");
  EXPECT_EQ(ev[1].unit, 3);
  EXPECT_EQ(ev[0].tid, ev[1].tid);
  EXPECT_LE(ev[1].start_ns, ev[0].start_ns);
  EXPECT_GE(ev[1].start_ns + ev[1].dur_ns, ev[0].start_ns + ev[0].dur_ns);
  EXPECT_NE(ev[2].tid, ev[0].tid);
  const std::vector<Track> tr = tracks();
  ASSERT_EQ(tr.size(), 2u);
  EXPECT_EQ(tr[0].name, "main");
  EXPECT_EQ(tr[1].name, "other");
}

// Four threads record overlapping spans into one lane pool: on every lane, spans are disjoint,
// and lanes are reused (far fewer lanes than spans).
TEST(TraceTest, LanesNeverOverlap) {
  start();
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([] {
      for (int i = 0; i < 200; ++i) {
        OUTCORE_TRACE_SPAN("work", "io", {.index = i, .lanes = "pool"});
        std::this_thread::yield();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  stop();
  std::map<uint32_t, std::vector<std::pair<int64_t, int64_t>>> lanes;
  for (const Event& e : events()) lanes[e.tid].emplace_back(e.start_ns, e.start_ns + e.dur_ns);
  EXPECT_GE(lanes.size(), 1u);
  EXPECT_LE(lanes.size(), 40u);
  size_t n = 0;
  for (auto& [tid, spans] : lanes) {
    n += spans.size();
    std::sort(spans.begin(), spans.end());
    for (size_t i = 1; i < spans.size(); ++i)
      ASSERT_LE(spans[i - 1].second, spans[i].first) << "lane " << tid << " span " << i;
  }
  EXPECT_EQ(n, 800u);
  for (const Track& t : tracks()) EXPECT_EQ(t.name.rfind("pool #", 0), 0u) << t.name;
}

TEST(TraceTest, IoOverlapCountsIoOutsideCompute) {
  auto ev = [](const char* cat, int64_t b, int64_t e) {
    Event x;
    x.cat = cat;
    x.start_ns = b;
    x.dur_ns = e - b;
    return x;
  };
  // I/O busy [0, 100) and [200, 300) (two overlapping requests in the first), compute
  // [50, 250), Adam [280, 290): exposed [0, 50) and [250, 300) under compute alone.
  const std::vector<Event> v = {ev("io", 0, 80),           ev("io", 40, 100),
                                ev("io", 200, 300),        ev("compute", 50, 250),
                                ev("optimizer", 280, 290), ev("wait", 0, 300)};
  const IoOverlap c = io_overlap(v, {"compute"});
  EXPECT_DOUBLE_EQ(c.io_busy_s, 200e-9);
  EXPECT_DOUBLE_EQ(c.io_exposed_s, 100e-9);
  EXPECT_DOUBLE_EQ(c.hidden_fraction, 0.5);
  const IoOverlap co = io_overlap(v, {"compute", "optimizer"});
  EXPECT_DOUBLE_EQ(co.io_exposed_s, 90e-9);
  EXPECT_DOUBLE_EQ(io_overlap({ev("compute", 0, 10)}, {"compute"}).hidden_fraction, 1.0);
}

TEST(TraceTest, WritesChromeTraceJson) {
  test::TempDir dir("trace");
  start();
  name_thread("quote \" and \\ name");
  complete("read", "io", 0, {.bytes = 8192, .file = "/a \"b\"\n.bin"});
  stop();
  const std::string path = (dir / "t.json").string();
  write_json(path, {"\"k\": 1.5"});
  std::ifstream in(path);
  const nlohmann::json j = nlohmann::json::parse(in);
  EXPECT_EQ(j.at("displayTimeUnit"), "ms");
  EXPECT_EQ(j.at("otherData").at("k"), 1.5);
  int x = 0, names = 0;
  for (const nlohmann::json& e : j.at("traceEvents")) {
    if (e.at("ph") == "X") {
      ++x;
      EXPECT_EQ(e.at("args").at("bytes"), 8192);
      EXPECT_EQ(e.at("args").at("file"), "/a \"b\"\n.bin");
      EXPECT_EQ(e.at("ts"), 0.0);
    } else if (e.at("name") == "thread_name") {
      ++names;
      EXPECT_EQ(e.at("args").at("name"), "quote \" and \\ name");
    }
  }
  EXPECT_EQ(x, 1);
  EXPECT_EQ(names, 1);
  EXPECT_THROW(write_json((dir / "missing/t.json").string()), IoError);
}

// A write that fails (here past a file size limit, as on a full disk) leaves what was at the
// path and no partial trace beside it.
TEST(TraceTest, AFailedWriteLeavesThePreviousFileAndNoPartialOne) {
  test::TempDir dir("trace");
  const std::string path = (dir / "t.json").string();
  const std::string previous = "{\"traceEvents\": [], \"otherData\": {\"previous\": 1}}\n";
  std::ofstream(path) << previous;
  start();
  for (int i = 0; i < 200; ++i) complete("read", "io", i, {.bytes = 4096});
  stop();
  const pid_t pid = fork();
  if (pid == 0) {
    std::signal(SIGXFSZ, SIG_IGN);
    const rlimit limit{4096, 4096};
    setrlimit(RLIMIT_FSIZE, &limit);
    try {
      write_json(path);
    } catch (const IoError&) {
      _exit(0);
    }
    _exit(1);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the write did not fail";
  std::ifstream in(path);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), previous);
  size_t entries = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir.path())) {
    (void)e;
    ++entries;
  }
  EXPECT_EQ(entries, 1u);
}

// A link is followed: the file it names is replaced (keeping its mode), the link stays a link.
TEST(TraceTest, WritingThroughALinkReplacesItsFileAndKeepsItsMode) {
  test::TempDir dir("trace");
  const std::filesystem::path file = dir / "t.json", link = dir / "link.json";
  std::ofstream(file) << "  {\n \"traceEvents\": []}";  // an earlier trace
  std::filesystem::permissions(
      file, std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  std::filesystem::create_symlink("t.json", link);
  start();
  complete("read", "io", 1, {.bytes = 4096});
  stop();
  write_json(link.string());
  EXPECT_TRUE(std::filesystem::is_symlink(link));
  std::ifstream in(file);
  const nlohmann::json j = nlohmann::json::parse(in);
  EXPECT_TRUE(j.contains("traceEvents"));
  EXPECT_EQ(std::filesystem::status(file).permissions() & std::filesystem::perms::all,
            std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  // A link to a file not made yet: the file is made where the link points.
  std::filesystem::create_directory(dir / "sub");
  std::filesystem::create_symlink("sub/new.json", dir / "ahead.json");
  write_json((dir / "ahead.json").string());
  EXPECT_TRUE(std::filesystem::is_symlink(dir / "ahead.json"));
  EXPECT_TRUE(std::filesystem::is_regular_file(dir / "sub" / "new.json"));
}

// A trace replaces only a trace (or an empty file): a user's file, or another run's data or
// metrics, at its path is kept and the write refused naming it.
TEST(TraceTest, ReplacesOnlyATrace) {
  test::TempDir dir("trace");
  start();
  complete("read", "io", 1, {.bytes = 4096});
  stop();
  for (const std::string& text :
       {std::string("my notes\n"), std::string("{\"type\": \"start\"}\n"), std::string("{")}) {
    const std::string path = (dir / "user.txt").string();
    std::ofstream(path) << text;
    EXPECT_FALSE(holds_trace_or_nothing(path)) << text;
    try {
      write_json(path);
      ADD_FAILURE() << "replaced " << text;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(path + ": exists and is not a trace file"),
                std::string::npos)
          << e.what();
    }
    std::ifstream in(path);
    EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), text);
  }
  EXPECT_TRUE(holds_trace_or_nothing((dir / "missing.json").string()));
  std::ofstream((dir / "empty.json").string()).flush();
  EXPECT_TRUE(holds_trace_or_nothing((dir / "empty.json").string()));
  EXPECT_FALSE(holds_trace_or_nothing(dir.path().string()));  // a directory
  write_json((dir / "empty.json").string());
  EXPECT_TRUE(holds_trace_or_nothing((dir / "empty.json").string()));
  write_json((dir / "empty.json").string());  // a trace replaces a trace
}

}  // namespace
}  // namespace outcore::trace
