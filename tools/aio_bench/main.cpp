// aio_bench: sweeps the aio engine's settings on a directory's drive, prints GB/s and
// latency per setting, and the best "aio" section ready to paste into a DeepSpeed config.
#include <fmt/format.h>
#include <linux/magic.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <new>
#include <optional>

#include "common/aligned_buffer.hpp"
#include "common/log.hpp"
#include "common/open_file.hpp"
#include "tools/aio_bench/cli_main.hpp"
#include "tools/aio_bench/scratch.hpp"
#include "tools/aio_bench/sizes.hpp"
#include "tools/aio_bench/sweep.hpp"
#include "tools/env_settings.hpp"

namespace outcore::aio_bench {
namespace {

using Clock = std::chrono::steady_clock;

struct Args {
  std::string path;
  std::string file_size = "1G";
  std::string io_size = "64M";
  double seconds = 0.5;
  double budget = 55;
  double tolerance = 0.05;
  bool full = false, json = false, compare_fio = false, no_read = false, no_write = false;
  bool no_register = false;
  std::vector<std::string> block_sizes, queue_depths, threads, single_submit, overlap_events;
};

uint64_t size_arg(const std::string& flag, const std::string& text, bool block) {
  auto v = parse_size(text);
  if (!v)
    throw UsageError(fmt::format("{} {}: not a size (examples: 4096, 128K, 1M, 4G)", flag, text));
  if (*v % kIoAlignment != 0) {
    throw UsageError(fmt::format("{} {}: must be a multiple of 4K (O_DIRECT)", flag, text));
  }
  if (block && *v > (1u << 30)) throw UsageError(fmt::format("{} {}: at most 1G", flag, text));
  return *v;
}

unsigned count_arg(const std::string& flag, const std::string& text, unsigned max) {
  auto v = parse_size(text);
  if (!v || *v > max || text.find_first_not_of("0123456789") != std::string::npos) {
    throw UsageError(fmt::format("{} {}: expected a whole number from 1 to {}", flag, text, max));
  }
  return static_cast<unsigned>(*v);
}

bool bool_arg(const std::string& flag, const std::string& text) {
  if (text == "true" || text == "1" || text == "yes") return true;
  if (text == "false" || text == "0" || text == "no") return false;
  throw UsageError(fmt::format("{} {}: expected true or false", flag, text));
}

Axes axes_from(const Args& a, bool* explicit_lists) {
  Axes ax = a.full ? full_axes() : default_axes();
  *explicit_lists = false;
  if (!a.block_sizes.empty()) {
    ax.block_sizes.clear();
    for (auto& s : a.block_sizes) ax.block_sizes.push_back(size_arg("--block-sizes", s, true));
    *explicit_lists = true;
  }
  if (!a.queue_depths.empty()) {
    ax.queue_depths.clear();
    for (auto& s : a.queue_depths) ax.queue_depths.push_back(count_arg("--queue-depths", s, 4096));
    *explicit_lists = true;
  }
  if (!a.threads.empty()) {
    ax.threads.clear();
    for (auto& s : a.threads) ax.threads.push_back(count_arg("--threads", s, 256));
    *explicit_lists = true;
  }
  if (!a.single_submit.empty()) {
    ax.single_submit.clear();
    for (auto& s : a.single_submit) ax.single_submit.push_back(bool_arg("--single-submit", s));
    *explicit_lists = true;
  }
  if (!a.overlap_events.empty()) {
    ax.overlap_events.clear();
    for (auto& s : a.overlap_events) ax.overlap_events.push_back(bool_arg("--overlap-events", s));
    *explicit_lists = true;
  }
  return ax;
}

class Progress {
 public:
  explicit Progress(size_t total) : total_(total), tty_(::isatty(2)), start_(Clock::now()) {}
  void add_total(size_t n) { total_ += n; }
  void step(const std::string& what) {
    ++done_;
    double el = std::chrono::duration<double>(Clock::now() - start_).count();
    double eta = done_ > 0 ? el / double(done_) * double(total_ - std::min(done_, total_)) : 0;
    std::string line =
        fmt::format("[{:>3}/{}] {} (elapsed {:.0f} s, ETA {:.0f} s)", done_, total_, what, el, eta);
    if (tty_) {
      std::fprintf(stderr, "\r%s\033[K", line.c_str());
    } else {
      std::fprintf(stderr, "%s\n", line.c_str());
    }
    std::fflush(stderr);
  }
  void finish() {
    if (tty_) std::fprintf(stderr, "\n");
  }
  size_t done() const { return done_; }
  size_t total() const { return total_; }

 private:
  size_t total_;
  size_t done_ = 0;
  bool tty_;
  Clock::time_point start_;
};

struct Sweep {
  const Args& args;
  ScratchFile& scratch;
  uint64_t file_size;
  std::span<std::byte> buffer;
  Progress progress;
  Clock::time_point deadline;  // default sweep only
  bool bounded;
  std::string fio_error;  // set when fio failed: the sweep stops

  bool over() const { return stop_requested() || !fio_error.empty(); }

  double seconds_now() const {
    if (!bounded) return args.seconds;
    double left = std::chrono::duration<double>(deadline - Clock::now()).count();
    size_t measurements_left = std::max<size_t>(1, progress.total() - progress.done());
    return std::clamp(left / double(measurements_left) * 0.8, 0.05, args.seconds);
  }

  void run(Row& row) {
    for (bool write : {false, true}) {
      if ((write && args.no_write) || (!write && args.no_read) || stop_requested()) continue;
      Workload w{.write = write,
                 .file_size = file_size,
                 .seconds = seconds_now(),
                 .register_buffer = !args.no_register};
      Result r = measure_engine(scratch.file(), buffer, row.opt, w, stop_requested);
      if (r.stopped) return;
      (write ? row.write : row.read) = r;
      std::string what =
          fmt::format("{:<5} {} {:.3f} GB/s", write ? "write" : "read", describe(row.opt), r.gbps);
      if (args.compare_fio && !stop_requested()) {
        Result f;
        try {
          f = measure_fio(scratch.path(), row.opt, w, stop_requested);
        } catch (const std::exception& e) {
          // The figures measured so far are still printed; the sweep ends here.
          fio_error = e.what();
          progress.step(what);
          return;
        }
        if (f.stopped) return;
        (write ? row.fio_write : row.fio_read) = f;
        what += fmt::format(", fio {:.3f} GB/s", f.gbps);
      }
      progress.step(what);
    }
  }
};

int run(const Args& args) {
  uint64_t file_size = size_arg("--file-size", args.file_size, false);
  uint64_t io_size = size_arg("--io-size", args.io_size, false);
  // Written so that NaN fails each test.
  if (!(args.seconds > 0 && args.seconds <= 600)) {
    throw UsageError(
        fmt::format("--seconds {}: expected more than 0 and at most 600", args.seconds));
  }
  if (!(args.budget > 0 && args.budget <= 86400)) {
    throw UsageError(
        fmt::format("--budget {}: expected more than 0 and at most 86400 seconds", args.budget));
  }
  if (!(args.tolerance >= 0 && args.tolerance < 1)) {
    throw UsageError(
        fmt::format("--tolerance {}: expected at least 0 and less than 1", args.tolerance));
  }
  if (args.no_read && args.no_write)
    throw UsageError("--no-read and --no-write leave nothing to do");
  if (file_size < (1 << 20)) throw UsageError("--file-size " + args.file_size + ": at least 1M");
  bool explicit_lists = false;
  Axes axes = axes_from(args, &explicit_lists);
  if (args.compare_fio && !fio_available()) {
    throw UsageError("--compare-fio: fio is not installed (apt-get install fio)");
  }
  aio::BackendChoice backend = backend_for_run();
  check_directory(args.path, file_size);

  uint64_t buffer_bytes = std::min(io_size, file_size) / (16 << 10) * (16 << 10);
  if (buffer_bytes == 0) throw UsageError("--io-size " + args.io_size + ": at least 16K");
  // Checked before the benchmark file is written: with nothing to measure, no write at all.
  std::vector<aio::Options> plan = grid(axes);
  std::erase_if(plan,
                [&](const aio::Options& o) { return o.block_size * o.thread_count > file_size; });
  if (plan.empty()) throw UsageError("every block size x thread count exceeds --file-size");
  install_stop_handlers();
  ScratchFile scratch(args.path, "aio_bench", file_size);
  std::optional<AlignedBuffer> held;
  try {
    held.emplace(buffer_bytes);
  } catch (const std::bad_alloc&) {
    throw UsageError(
        fmt::format("--io-size {}: cannot allocate its {} buffer; choose a smaller "
                    "--io-size",
                    args.io_size, format_size(buffer_bytes)));
  }
  AlignedBuffer& buffer = *held;
  std::span<std::byte> buf(buffer.data(), buffer.size());
  // A filesystem in memory measures memory, not a drive: its figures would tune nothing.
  struct statfs fs_info {};
  if (::statfs(args.path.c_str(), &fs_info) == 0 &&
      (fs_info.f_type == TMPFS_MAGIC || fs_info.f_type == RAMFS_MAGIC))
    std::fprintf(stderr,
                 "aio_bench: warning: %s is on a filesystem in memory (%s): the figures are "
                 "memory's, not a drive's; give --path a directory on the drive swap files "
                 "will use\n",
                 args.path.c_str(), fs_info.f_type == TMPFS_MAGIC ? "tmpfs" : "ramfs");
  std::fprintf(stderr, "aio_bench: aio backend %s; writing the %s benchmark file %s\n",
               describe_backend(backend).c_str(), format_size(file_size).c_str(),
               scratch.path().c_str());
  fill_file(scratch.file(), buf, file_size);

  bool staged = !args.full && !explicit_lists;
  int directions = (args.no_read ? 0 : 1) + (args.no_write ? 0 : 1);
  Sweep sweep{args,
              scratch,
              file_size,
              buf,
              Progress(plan.size() * directions),
              Clock::now() + std::chrono::milliseconds(long(args.budget * 1000)),
              staged,
              {}};
  if (staged) sweep.progress.add_total(refine(plan.front()).size() * directions);

  std::vector<Row> rows;
  rows.reserve(plan.size() + 8);
  for (const aio::Options& o : plan) {
    if (sweep.over()) break;
    rows.push_back({.opt = o});
    sweep.run(rows.back());
  }
  if (staged && !sweep.over()) {
    if (const Row* first = choose(rows, args.tolerance)) {
      for (const aio::Options& o : refine(first->opt)) {
        if (sweep.over()) break;
        rows.push_back({.opt = o});
        sweep.run(rows.back());
      }
    }
  }
  sweep.progress.finish();
  std::erase_if(rows, [](const Row& r) { return !r.read && !r.write; });

  // A sweep cut short by a signal or by fio's failure recommends nothing.
  bool interrupted = sweep.over();
  const Row* best = choose(rows, args.tolerance);
  if (args.json) {
    std::printf("%s\n", to_json(rows, best, backend, args.path, file_size, interrupted).c_str());
  } else {
    print_table(rows, backend, args.compare_fio);
    if (best != nullptr && interrupted) {
      // A sweep cut short recommends nothing: its best may only be the best of a few settings.
      // A direction not measured before the stop has no figure (not 0 GB/sec).
      auto rate = [](const auto& m) {
        return m ? fmt::format("{:.3f}", m->gbps) : std::string("not measured");
      };
      std::printf(
          "\n%s after %zu setting(s): no recommendation (rerun the whole sweep for "
          "one); the best so far read = %s, write = %s GB/sec (%s)\n",
          sweep.fio_error.empty() ? "Interrupted" : "fio failed", rows.size(),
          rate(best->read).c_str(), rate(best->write).c_str(), describe(best->opt).c_str());
    } else if (best != nullptr) {
      std::printf(
          "\nBest performance (GB/sec): read = %.3f, write = %.3f  (%s; the fewest bytes "
          "in flight within %.0f%% of the top score)\n",
          best->read ? best->read->gbps : 0.0, best->write ? best->write->gbps : 0.0,
          describe(best->opt).c_str(), args.tolerance * 100);
      std::printf("%s\n", aio_section(best->opt, 0).c_str());
    }
  }
  if (!sweep.fio_error.empty()) {
    std::fprintf(stderr, "aio_bench: --compare-fio: %s; %s removed\n", sweep.fio_error.c_str(),
                 scratch.path().c_str());
    return 1;
  }
  if (interrupted) {
    std::fprintf(stderr, "aio_bench: interrupted by signal %d; %s removed\n", stop_signal(),
                 scratch.path().c_str());
    return 130;
  }
  return 0;
}

}  // namespace
}  // namespace outcore::aio_bench

int main(int argc, char** argv) {
  using namespace outcore::aio_bench;
  outcore::open_missing_standard_streams();
  // A write past the file-size limit (ulimit -f) fails with EFBIG, which the scratch file
  // reports and cleans up, instead of SIGXFSZ ending the process with its file left behind.
  std::signal(SIGXFSZ, SIG_IGN);
  outcore::log::init("warn");
  outcore::tools::apply_environment_settings();
  Args a;
  CLI::App app{
      "aio_bench: sweep the aio engine's block size, queue depth, threads, submission and "
      "completion modes on the drive holding --path; print GB/s and latency per setting and "
      "the best \"aio\" config section. The default sweep takes about a minute."};
  app.add_option("--path", a.path, "directory on the drive to test (a file is created there)")
      ->required();
  app.add_option("--file-size", a.file_size, "size of the benchmark file (default 1G)");
  app.add_option("--io-size", a.io_size, "buffer streamed as 4 spans in flight (default 64M)");
  app.add_option("--seconds", a.seconds, "seconds per setting and direction (default 0.5)");
  app.add_option("--budget", a.budget, "target seconds for the default sweep (default 55)");
  app.add_option("--tolerance", a.tolerance,
                 "recommend the smallest setting within this fraction of the best (default 0.05)");
  app.add_flag("--full", a.full,
               "sweep the full grid (block 128K-8M, depth 1-128, threads "
               "1-8, single submit, overlap); takes long");
  app.add_flag("--json", a.json, "print results as JSON on stdout");
  app.add_flag("--compare-fio", a.compare_fio, "also run fio with each setting; print ratios");
  app.add_flag("--no-read", a.no_read, "skip reads");
  app.add_flag("--no-write", a.no_write, "skip writes");
  app.add_flag("--no-register", a.no_register, "do not register the buffer with the kernel");
  app.add_option("--block-sizes", a.block_sizes, "comma list, e.g. 128K,1M")->delimiter(',');
  app.add_option("--queue-depths", a.queue_depths, "comma list, e.g. 8,32")->delimiter(',');
  app.add_option("--threads", a.threads, "comma list of I/O thread counts")->delimiter(',');
  app.add_option("--single-submit", a.single_submit, "comma list of true/false")->delimiter(',');
  app.add_option("--overlap-events", a.overlap_events, "comma list of true/false")->delimiter(',');
  return parse_and_run(app, "aio_bench", argc, argv, [&] { return run(a); });
}
