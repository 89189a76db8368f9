// Metrics: the step and validation lines, the progress display's two modes, and the
// JSON-lines writer (records, append, I/O errors).
#include "engine/train/metrics.hpp"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "tests/common/log_capture.hpp"
#include "tests/train/temp_dir.hpp"

namespace outcore::train {
namespace {

using testing::TempDir;

std::string whole(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

StepMetrics sample() {
  StepMetrics m;
  m.step = 12;
  m.total_steps = 1000;
  m.loss = 3.45213;
  m.lr = 1e-3;
  m.tokens_per_s = 12345;
  m.gflops_per_s = 45.67;
  m.device_mem_peak_bytes = 3ull << 29;  // 1.5 GiB
  m.step_time_s = 0.25;
  m.elapsed_s = 3.0;
  m.io = {{"nvme", 1.5, 0.75}, {"host", 10.0, 9.0}};
  return m;
}

std::string read_all(std::FILE* f) {
  std::rewind(f);
  std::string s;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) s.append(buf, n);
  return s;
}

std::vector<std::string> read_lines(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string l; std::getline(in, l);) lines.push_back(l);
  return lines;
}

TEST(Metrics, StepLineShowsEveryField) {
  std::string line = format_step_line(sample());
  EXPECT_EQ(line,
            "step 12/1000 | loss 3.4521 | lr 1.000e-03 | 12.3k tok/s | 45.7 GFLOP/s | mem 1.50 "
            "GiB | nvme r 1.50 w 0.75 GB/s | host r 10.00 w 9.00 GB/s");
  StepMetrics m = sample();
  m.total_steps = 0;
  m.io.clear();
  m.grad_norm = 0.5;
  m.loss_scale = 65536;
  m.skipped = true;
  line = format_step_line(m);
  EXPECT_EQ(line.rfind("step 12 |", 0), 0u) << line;
  EXPECT_NE(line.find("gnorm 0.500"), std::string::npos) << line;
  EXPECT_NE(line.find("scale 65536"), std::string::npos) << line;
  EXPECT_NE(line.find("SKIPPED"), std::string::npos) << line;
  EXPECT_EQ(line.find("GB/s"), std::string::npos) << line;
  // A masked step with no target shows no loss (its recorded 0 is no figure).
  m = sample();
  m.masked = true;
  m.tokens_trained = 0;
  m.loss = 0;
  line = format_step_line(m);
  EXPECT_NE(line.find("| loss    -   | lr"), std::string::npos) << line;
  EXPECT_NE(line.find("trained 0 tok"), std::string::npos) << line;
}

TEST(Metrics, ValidationLine) {
  EXPECT_EQ(format_validation_line({.step = 50, .loss = 2.5, .tokens = 65536, .time_s = 1.2}),
            "val step 50 | loss 2.5000 | 65.5k tokens | 1.20 s");
}

TEST(Metrics, LinesModeWritesOneLinePerStep) {
  std::FILE* f = std::tmpfile();
  ASSERT_NE(f, nullptr);
  {
    ProgressDisplay d(f);  // a file is not a terminal: auto picks lines
    EXPECT_EQ(d.mode(), ProgressDisplay::Mode::kLines);
    StepMetrics m = sample();
    d.step(m);
    m.step = 13;
    d.step(m);
    d.validation({.step = 13, .loss = 2.0, .tokens = 100, .time_s = 0.1});
  }
  std::string out = read_all(f);
  std::fclose(f);
  EXPECT_EQ(out.find('\r'), std::string::npos);
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 3);
  EXPECT_NE(out.find("step 13/1000"), std::string::npos);
}

// steps_per_print in lines mode: every N-th step, and the first, the last and a skipped one.
TEST(Metrics, LinesModeKeepsEveryNthStepTheEndsAndSkippedOnes) {
  std::FILE* f = std::tmpfile();
  ASSERT_NE(f, nullptr);
  {
    ProgressDisplay d(f, ProgressDisplay::Mode::kLines, 5);
    StepMetrics m = sample();
    m.total_steps = 12;
    for (int64_t s = 1; s <= 12; ++s) {
      m.step = s;
      m.skipped = s == 7;
      d.step(m);
    }
  }
  const std::string out = read_all(f);
  std::fclose(f);
  std::vector<int64_t> shown;
  for (int64_t s = 1; s <= 12; ++s)
    if (out.find(fmt::format("step {}/12 ", s)) != std::string::npos) shown.push_back(s);
  EXPECT_EQ(shown, (std::vector<int64_t>{1, 5, 7, 10, 12})) << out;
}

TEST(Metrics, RefreshModeOverwritesTheLineAndKeepsOthersWhole) {
  std::FILE* f = std::tmpfile();
  ASSERT_NE(f, nullptr);
  {
    ProgressDisplay d(f, ProgressDisplay::Mode::kRefresh);
    StepMetrics m = sample();
    d.step(m);
    m.step = 13;
    d.step(m);
    d.message("checkpoint saved");
    m.step = 14;
    d.step(m);
  }  // the destructor ends the pending line
  std::string out = read_all(f);
  std::fclose(f);
  EXPECT_EQ(
      out, "\r\x1b[2K" + format_step_line(sample()) + "\r\x1b[2K" +
               [] {
                 auto m = sample();
                 m.step = 13;
                 return format_step_line(m);
               }() +
               "\r\x1b[2Kcheckpoint saved\n\r\x1b[2K" +
               [] {
                 auto m = sample();
                 m.step = 14;
                 return format_step_line(m);
               }() +
               "\n");
}

TEST(Metrics, RefreshModeKeepsEveryNthLine) {
  std::FILE* f = std::tmpfile();
  ASSERT_NE(f, nullptr);
  {
    ProgressDisplay d(f, ProgressDisplay::Mode::kRefresh, /*keep_every=*/2);
    StepMetrics m = sample();
    for (int s = 1; s <= 4; ++s) {
      m.step = s;
      d.step(m);
    }
    d.finish();
    d.finish();
  }
  std::string out = read_all(f);
  std::fclose(f);
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 2);  // steps 2 and 4
}

TEST(Metrics, JsonRecordsHaveTypedFields) {
  nlohmann::ordered_json j = to_json(sample());
  EXPECT_EQ(j["type"], "step");
  EXPECT_EQ(j["step"], 12);
  EXPECT_EQ(j["loss"], 3.45213);
  EXPECT_EQ(j["device_mem_peak_bytes"], 3ull << 29);
  EXPECT_EQ(j["io"]["nvme"]["read_gb_per_s"], 1.5);
  EXPECT_EQ(j["io"]["host"]["write_gb_per_s"], 9.0);
  EXPECT_FALSE(j.contains("grad_norm"));
  EXPECT_FALSE(j.contains("loss_scale"));
  StepMetrics m = sample();
  m.loss = NAN;
  m.grad_norm = 2.0;
  j = to_json(m);
  EXPECT_TRUE(j["loss"].is_null());
  EXPECT_EQ(j["grad_norm"], 2.0);
  nlohmann::ordered_json v = to_json(ValidationMetrics{.step = 7, .loss = 1.25, .tokens = 10});
  EXPECT_EQ(v["type"], "val");
  EXPECT_EQ(v["loss"], 1.25);
  // A step, or a validation, whose loss mask left no target has no loss: null, not 0.
  m = sample();
  m.masked = true;
  m.tokens_trained = 0;
  m.loss = 0;
  j = to_json(m);
  EXPECT_TRUE(j["loss"].is_null());
  EXPECT_EQ(j["tokens_trained"], 0);
  m.tokens_trained = 1;
  EXPECT_EQ(to_json(m)["loss"], 0.0);
  ValidationMetrics none{.step = 7, .loss = 0, .tokens = 10, .tokens_trained = 0};
  none.masked = true;
  EXPECT_TRUE(to_json(none)["loss"].is_null());
  EXPECT_NE(format_validation_line(none).find("| loss    -   |"), std::string::npos)
      << format_validation_line(none);
}

TEST(MetricsWriter, WritesOneParsableObjectPerLine) {
  TempDir dir;
  std::string path = dir.file("m.jsonl");
  {
    MetricsWriter w(path);
    w.write(sample());
    w.write(ValidationMetrics{.step = 12, .loss = 2.0, .tokens = 4096, .time_s = 0.5});
    w.write_json({{"type", "start"}, {"seed", 1}});
    w.close();
    w.close();  // idempotent
    EXPECT_THROW(w.write(sample()), InvalidArgument);
  }
  auto lines = read_lines(path);
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(nlohmann::json::parse(lines[0])["step"], 12);
  EXPECT_EQ(nlohmann::json::parse(lines[1])["type"], "val");
  EXPECT_EQ(nlohmann::json::parse(lines[2])["seed"], 1);
}

TEST(MetricsWriter, AppendKeepsEarlierRecordsTruncateDoesNot) {
  TempDir dir;
  std::string path = dir.file("m.jsonl");
  { MetricsWriter(path).write(sample()); }
  { MetricsWriter(path, /*append=*/true).write(sample()); }
  EXPECT_EQ(read_lines(path).size(), 2u);
  { MetricsWriter(path).write(sample()); }
  EXPECT_EQ(read_lines(path).size(), 1u);
}

// A run resumed at step N cuts the records an earlier process wrote after step N (it went on
// past the checkpoint), from the first of them on, at its first record: each step is recorded
// once. A run refused before its first record leaves the file as it was.
TEST(MetricsWriter, AResumedRunCutsTheRecordsOfStepsAfterItsCheckpoint) {
  TempDir dir;
  const std::string path = dir.file("m.jsonl");
  {
    MetricsWriter w(path);
    w.write_json({{"type", "start"}});
    for (int step = 1; step <= 5; ++step) w.write_json({{"type", "step"}, {"step", step}});
    w.write_json({{"type", "val"}, {"step", 4}});
  }
  const std::string before = whole(path);
  { MetricsWriter refused(path, /*append=*/true, /*resumed_at=*/2); }
  EXPECT_EQ(whole(path), before);
  {
    outcore::test::LogCapture log;
    MetricsWriter w(path, /*append=*/true, /*resumed_at=*/2);
    w.write_json({{"type", "start"}, {"resumed_at_step", 2}});
    w.write_json({{"type", "step"}, {"step", 3}});
    EXPECT_NE(log.text().find("4 records from the first of a step after 2 on removed"),
              std::string::npos)
        << log.text();
  }
  std::vector<int64_t> steps;
  for (const std::string& line : read_lines(path))
    steps.push_back(nlohmann::json::parse(line).value("step", int64_t{-1}));
  EXPECT_EQ(steps, (std::vector<int64_t>{-1, 1, 2, -1, 3}));
  // Resumed at the last step recorded: nothing to cut.
  const std::string now = whole(path);
  { MetricsWriter(path, true, 3).write_json({{"type", "start"}}); }
  EXPECT_EQ(whole(path).substr(0, now.size()), now);
  // A last record cut short by a crash is cut, so the next record starts its own line.
  const std::string whole_records = whole(path);
  std::ofstream(path, std::ios::app) << "{\"type\": \"step\", \"st";
  { MetricsWriter(path, true, 3).write_json({{"type", "start"}}); }
  EXPECT_EQ(whole(path), whole_records + "{\"type\":\"start\"}\n");
}

// A resumed run appends only to a file that holds its checkpoint's run's last record where that
// run wrote it (else another run wrote the file since: refused, the file kept), and cuts no
// records that later checkpoints of the run continue (a branch: refused, the file kept).
TEST(MetricsWriter, AResumedRunAppendsOnlyToItsRunsRecordsAndCutsNoOtherBranch) {
  TempDir dir;
  const std::string path = dir.file("m.jsonl");
  MetricsResume at2;
  {
    MetricsWriter w(path);
    w.write_json({{"type", "start"}, {"seed", 1}});
    for (int step = 1; step <= 5; ++step) {
      w.write_json({{"type", "step"}, {"step", step}});
      if (step == 2) {
        at2.step = 2;
        at2.bytes = w.end();
        at2.last_record = w.last_record();
      }
    }
  }
  EXPECT_EQ(at2.last_record, R"({"type":"step","step":2})");
  const std::string first_run = whole(path);
  // Another run (seed 1234) replaced the file since.
  {
    MetricsWriter other(path);
    other.write_json({{"type", "start"}, {"seed", 1234}});
    for (int step = 1; step <= 6; ++step) other.write_json({{"type", "step"}, {"step", step}});
  }
  const std::string second_run = whole(path);
  try {
    MetricsWriter refused(path, at2);
    ADD_FAILURE() << "appended to another run's records";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(path + ": does not hold the records of the run"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(whole(path), second_run);
  // The run's own file: a branch from step 2 while checkpoints at 4 and 5 remain is refused...
  std::ofstream(path, std::ios::trunc) << first_run;
  MetricsResume branch = at2;
  branch.later_checkpoints = "ck/global_step4, ck/global_step5";
  try {
    MetricsWriter refused(path, branch);
    ADD_FAILURE() << "cut the records that later checkpoints continue";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("holds 3 records from step 3 on, which "
                                         "ck/global_step4, ck/global_step5 of the same run"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(whole(path), first_run);
  // ... and without them (the process stopped after step 5, its last checkpoint at 2), resumed.
  {
    MetricsWriter w(path, at2);
    w.write_json({{"type", "step"}, {"step", 3}});
  }
  EXPECT_EQ(whole(path), first_run.substr(0, at2.bytes) + "{\"type\":\"step\",\"step\":3}\n");
}

// A fresh run replaces a metrics file, never a user's other file at that path (kept whole,
// refused naming it), and only once it writes; a second writer of one file is refused while the
// first holds it.
TEST(MetricsWriter, NeverCutsAUsersFileNorSharesOne) {
  TempDir dir;
  const std::string users = dir.file("notes.txt");
  for (const std::string& text :
       {std::string("my notes\n"), std::string("[1, 2]\n"), std::string("{\"no type\": 1}\n"),
        std::string("no newline"),
        // a user's JSON lines with a "type" of their own
        std::string("{\"type\": \"conversation\", \"text\": \"hi\"}\n")}) {
    std::ofstream(users) << text;
    for (const bool append : {false, true}) {  // a fresh run, a resumed one
      try {
        MetricsWriter w(users, append);
        ADD_FAILURE() << "took " << text;
      } catch (const InvalidArgument& e) {
        EXPECT_NE(std::string(e.what()).find(users + ": exists and is not a metrics file"),
                  std::string::npos)
            << e.what();
      }
      std::ifstream in(users);
      EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), text);
    }
  }
  // A file a writer created and wrote nothing to (a run refused at start) goes again.
  const std::string unwritten = dir.file("unwritten.jsonl");
  { MetricsWriter w(unwritten); }
  EXPECT_FALSE(std::filesystem::exists(unwritten));
  // Unless a file was moved to its name meanwhile: that one is someone else's, and kept.
  {
    MetricsWriter w(unwritten);
    std::ofstream(users) << "moved here\n";
    std::filesystem::rename(users, unwritten);
  }
  ASSERT_TRUE(std::filesystem::exists(unwritten));
  std::ifstream moved(unwritten);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(moved), {}), "moved here\n");
  const std::string path = dir.file("m.jsonl");
  { MetricsWriter(path).write(sample()); }
  {
    MetricsWriter fresh(path);  // an earlier run's metrics: replaced at the first record
    EXPECT_EQ(read_lines(path).size(), 1u);
    try {
      MetricsWriter second(path, /*append=*/true);
      ADD_FAILURE() << "two writers of one metrics file";
    } catch (const PathBusy& e) {
      EXPECT_NE(std::string(e.what()).find("another run is writing it"), std::string::npos)
          << e.what();
    }
    fresh.write(sample());
    fresh.write(sample());
  }
  EXPECT_EQ(read_lines(path).size(), 2u);
}

// A device is written, never locked or checked: two runs may both write to /dev/null.
TEST(MetricsWriter, ADeviceIsNeitherLockedNorChecked) {
  MetricsWriter first("/dev/null");
  MetricsWriter second("/dev/null");
  first.write(sample());
  second.write(sample());
}

TEST(MetricsWriter, ErrorsNameThePath) {
  try {
    MetricsWriter w("/nonexistent_dir_outcore/m.jsonl");
    FAIL() << "no error";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent_dir_outcore/m.jsonl"), std::string::npos);
  }
  if (!std::filesystem::exists("/dev/full")) GTEST_SKIP() << "no /dev/full";
  MetricsWriter full("/dev/full");
  try {
    full.write(sample());
    FAIL() << "no error";
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_number(), ENOSPC);
    EXPECT_EQ(e.file(), "/dev/full");
  }
}

// Runs `writes` in a child process whose files may not grow past `limit` bytes (a disk that
// fills: writes beyond it are short, then fail with EFBIG). The child's exit status: 0 when
// `writes` ended with that EFBIG, 3 with another IoError, 4 when nothing failed.
int exit_status_under_file_limit(rlim_t limit, const std::function<void()>& writes) {
  pid_t pid = fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    std::signal(SIGXFSZ, SIG_IGN);
    struct rlimit rl {};
    rl.rlim_cur = rl.rlim_max = limit;
    if (setrlimit(RLIMIT_FSIZE, &rl) != 0) _exit(5);
    try {
      writes();
    } catch (const IoError& e) {
      _exit(e.error_number() == EFBIG ? 0 : 3);
    }
    _exit(4);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// A disk that fills in the middle of a record (here: the file size limit, which makes the
// write short) leaves only whole records: the partial one is cut off.
TEST(MetricsWriter, AShortWriteLeavesNoHalfRecord) {
  testing::TempDir dir;
  const std::string path = dir.file("m.jsonl");
  const std::string one = [&] {
    MetricsWriter w(dir.file("probe.jsonl"));
    w.write(sample());
    w.close();
    return read_lines(dir.file("probe.jsonl")).at(0);
  }();
  const rlim_t two_and_a_half = 2 * (one.size() + 1) + one.size() / 2;
  ASSERT_EQ(exit_status_under_file_limit(two_and_a_half,
                                         [&] {
                                           MetricsWriter w(path);
                                           for (int i = 0; i < 10; ++i) w.write(sample());
                                         }),
            0);
  std::ifstream in(path, std::ios::binary);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text.size(), 2 * (one.size() + 1));  // two whole records, no third half
  EXPECT_EQ(read_lines(path).size(), 2u);
}

// A disk full at the first record: the run that created the file and wrote nothing to it leaves
// no empty metrics file behind.
TEST(MetricsWriter, AFirstRecordThatCannotBeWrittenLeavesNoFile) {
  testing::TempDir dir;
  const std::string path = dir.file("m.jsonl");
  ASSERT_EQ(exit_status_under_file_limit(10,  // less than one record
                                         [&] { MetricsWriter(path).write(sample()); }),
            0);
  EXPECT_FALSE(std::filesystem::exists(path));
}

}  // namespace
}  // namespace outcore::train
