// measure_fio: run fio as a subprocess with --output-format=json and read its result.
#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>
#include <vector>

#include "tools/aio_bench/measure.hpp"

extern char** environ;

namespace outcore::aio_bench {
namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Runs argv with stdout/stderr sent to files; returns the exit status, or -1 if stopped.
// `cpu_seconds` (optional) receives the child's user + system CPU time.
int run_process(const std::vector<std::string>& argv, const std::string& out_path,
                const std::string& err_path, const StopFn& stop, double* cpu_seconds = nullptr) {
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  posix_spawn_file_actions_addopen(&fa, 2, err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  pid_t pid = 0;
  int rc = posix_spawnp(&pid, args[0], &fa, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) throw Error(fmt::format("cannot run {}: {}", argv[0], errno_string(rc)));
  bool killed = false;
  for (;;) {
    int status = 0;
    rusage ru{};
    pid_t w = ::wait4(pid, &status, WNOHANG, &ru);
    if (w == pid) {
      if (cpu_seconds != nullptr) {
        *cpu_seconds = double(ru.ru_utime.tv_sec) + double(ru.ru_utime.tv_usec) / 1e6 +
                       double(ru.ru_stime.tv_sec) + double(ru.ru_stime.tv_usec) / 1e6;
      }
      if (killed) return -1;
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    if (w < 0 && errno != EINTR) throw Error("waitpid on fio failed: " + errno_string(errno));
    if (!killed && stop && stop()) {
      ::kill(pid, SIGTERM);
      killed = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

std::string first_line(const std::string& s) {
  std::string line = s.substr(0, s.find('\n'));
  return line.empty() ? "(no message)" : line;
}

}  // namespace

bool fio_available() {
  try {
    return run_process({"fio", "--version"}, "/dev/null", "/dev/null", nullptr) == 0;
  } catch (const Error&) {
    return false;
  }
}

Result measure_fio(const std::string& path, const aio::Options& opt, const Workload& w,
                   const StopFn& stop) {
  unsigned jobs = opt.thread_count;
  uint64_t per_job = w.file_size / jobs / opt.block_size * opt.block_size;
  if (per_job == 0) throw InvalidArgument("fio: the file is smaller than one block per job");
  std::vector<std::string> argv = {
      "fio",
      "--name=aio_bench",
      "--filename=" + path,
      std::string("--rw=") + (w.write ? "write" : "read"),
      fmt::format("--bs={}", opt.block_size),
      fmt::format("--iodepth={}", opt.queue_depth),
      "--ioengine=io_uring",
      "--direct=1",
      "--thread",
      "--invalidate=0",
      "--fallocate=none",
      fmt::format("--numjobs={}", jobs),
      fmt::format("--size={}", per_job),
      fmt::format("--offset_increment={}", per_job),
      "--group_reporting",
      fmt::format("--iodepth_batch_submit={}", opt.single_submit ? 1 : opt.queue_depth),
      fmt::format("--iodepth_batch_complete_min={}", opt.overlap_events ? 1 : opt.queue_depth),
      "--output-format=json",
  };
  if (w.seconds > 0) {
    argv.push_back("--time_based");
    argv.push_back(fmt::format("--runtime={}ms", static_cast<long>(w.seconds * 1000)));
  }
  // fio's output in a directory this call makes (mkdtemp): no file of anyone else's is opened.
  std::error_code tmp_ec;
  const std::filesystem::path tmp = std::filesystem::temp_directory_path(tmp_ec);
  if (tmp_ec) {
    const char* named = std::getenv("TMPDIR");
    throw Error(fmt::format("cannot make a directory for fio's output: TMPDIR {}: {}",
                            named != nullptr ? named : "(unset)", tmp_ec.message()));
  }
  std::string dir = (tmp / "outcore_fio_XXXXXX").string();
  if (::mkdtemp(dir.data()) == nullptr)
    throw Error(fmt::format("cannot make a directory for fio's output in {}: {}", tmp.string(),
                            errno_string(errno)));
  const std::string out = dir + "/fio.json", err = dir + "/fio.err";
  double cpu = 0;
  int rc = 0;
  std::string json_text, err_text;
  try {
    rc = run_process(argv, out, err, stop, &cpu);
    json_text = read_file(out);
    err_text = read_file(err);
  } catch (...) {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
    throw;
  }
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  Result r;
  r.cpu_seconds = cpu;
  if (rc < 0) {
    r.stopped = true;
    return r;
  }
  if (rc != 0) throw Error(fmt::format("fio exited with status {}: {}", rc, first_line(err_text)));
  size_t brace = json_text.find('{');  // fio may print notes before the JSON
  nlohmann::json doc = nlohmann::json::parse(
      brace == std::string::npos ? std::string() : json_text.substr(brace), nullptr, false);
  if (doc.is_discarded() || !doc.contains("jobs") || doc["jobs"].empty()) {
    throw Error("fio printed no JSON result: " + first_line(err_text + json_text));
  }
  const auto& job = doc["jobs"][0][w.write ? "write" : "read"];
  r.bytes = job.value("io_bytes", uint64_t{0});
  r.seconds = job.value("runtime", 0.0) / 1000.0;
  r.gbps = job.value("bw_bytes", 0.0) / 1e9;
  if (job.contains("clat_ns") && job["clat_ns"].contains("percentile")) {
    const auto& p = job["clat_ns"]["percentile"];
    r.p50_us = p.value("50.000000", uint64_t{0}) / 1000;
    r.p99_us = p.value("99.000000", uint64_t{0}) / 1000;
  }
  return r;
}

}  // namespace outcore::aio_bench
