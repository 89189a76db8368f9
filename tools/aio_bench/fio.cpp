// measure_fio: run fio as a subprocess with --output-format=json and read its result.
#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <sys/prctl.h>
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

namespace outcore::aio_bench {
namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Runs argv with stdout/stderr sent to files; returns the exit status, or -1 if stopped.
// `cpu_seconds` (optional) receives the child's user + system CPU time. The child is killed
// when this thread ends (PR_SET_PDEATHSIG), so a benchmark killed at once leaves no fio running.
int run_process(const std::vector<std::string>& argv, const std::string& out_path,
                const std::string& err_path, const StopFn& stop, double* cpu_seconds = nullptr) {
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  // Opened before the fork: the child only duplicates them (async-signal-safe calls only there).
  const int out = ::open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  const int err =
      out < 0 ? -1 : ::open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (out < 0 || err < 0) {
    const int e = errno;
    if (out >= 0) ::close(out);
    throw Error(fmt::format("cannot run {}: cannot create {}: {}", argv[0],
                            out < 0 ? out_path : err_path, errno_string(e)));
  }
  int ready[2];  // the child's exec error, if any, comes back here (closed on a good exec)
  if (::pipe2(ready, O_CLOEXEC) != 0) {
    const int e = errno;
    ::close(out);
    ::close(err);
    throw Error(fmt::format("cannot run {}: pipe: {}", argv[0], errno_string(e)));
  }
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);  // the parent died before the line above
    ::dup2(out, 1);
    ::dup2(err, 2);
    ::execvp(args[0], args.data());
    const int e = errno;
    (void)!::write(ready[1], &e, sizeof e);
    ::_exit(127);
  }
  const int fork_errno = errno;
  ::close(ready[1]);
  ::close(out);
  ::close(err);
  if (pid < 0) {
    ::close(ready[0]);
    throw Error(fmt::format("cannot run {}: fork: {}", argv[0], errno_string(fork_errno)));
  }
  int exec_errno = 0;
  ssize_t got;
  do got = ::read(ready[0], &exec_errno, sizeof exec_errno);
  while (got < 0 && errno == EINTR);
  ::close(ready[0]);
  if (got == static_cast<ssize_t>(sizeof exec_errno)) {
    int status = 0;
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    throw Error(fmt::format("cannot run {}: {}", argv[0], errno_string(exec_errno)));
  }
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
    if (json_text.empty() && err_text.empty())  // its output went nowhere: a full TMPDIR?
      throw Error(fmt::format(
          "fio exited with status 0 and wrote no result to its output in {} (full? set TMPDIR "
          "to a directory with room)",
          tmp.string()));
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
