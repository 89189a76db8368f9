// bench_aio: one sequential pass of writes and one of reads over a file (default 4 GiB, 1 MiB
// requests, queue depth 32), through the aio engine and through fio (io_uring, O_DIRECT) on
// the same file in the same run, alternating which goes first. Prints each pass and the
// ratio ours / fio per direction (median over --repeat rounds). The goal is >= 0.95.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <vector>

#include "common/aligned_buffer.hpp"
#include "common/log.hpp"
#include "tools/aio_bench/cli_main.hpp"
#include "tools/aio_bench/measure.hpp"
#include "tools/aio_bench/scratch.hpp"
#include "tools/aio_bench/sizes.hpp"
#include "tools/env_settings.hpp"

namespace outcore::aio_bench {
namespace {

struct Args {
  std::string path;
  std::string file_size = "4G";
  std::string block_size = "1M";
  unsigned queue_depth = 32;
  unsigned threads = 1;
  int repeat = 5;
  std::string io_size = "128M";
  bool no_register = false;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

uint64_t size_or_die(const std::string& flag, const std::string& text) {
  auto v = parse_size(text);
  if (!v || *v % kIoAlignment != 0) {
    throw UsageError(fmt::format("{} {}: expected a size that is a multiple of 4K", flag, text));
  }
  return *v;
}

int run(const Args& a) {
  uint64_t file_size = size_or_die("--file-size", a.file_size);
  aio::Options opt{.block_size = size_or_die("--block-size", a.block_size),
                   .queue_depth = a.queue_depth,
                   .thread_count = a.threads};
  try {
    aio::validate(opt);
  } catch (const InvalidArgument& e) {
    throw UsageError(e.what());
  }
  if (a.repeat < 1 || a.repeat > 100) throw UsageError("--repeat: 1 to 100");
  if (!fio_available()) throw UsageError("fio is not installed (apt-get install fio)");
  aio::BackendChoice backend = backend_for_run();
  check_directory(a.path, file_size);
  uint64_t io = std::min(size_or_die("--io-size", a.io_size), file_size) / (16 << 10) * (16 << 10);
  if (io == 0) throw UsageError("--io-size: at least 16K");

  install_stop_handlers();
  ScratchFile scratch(a.path, "bench_aio", file_size);
  AlignedBuffer buffer(io);
  std::span<std::byte> buf(buffer.data(), buffer.size());
  std::fprintf(stderr, "bench_aio: writing the %s file %s\n", format_size(file_size).c_str(),
               scratch.path().c_str());
  fill_file(scratch.file(), buf, file_size);

  std::printf(
      "bench_aio: one sequential pass per direction over a %s file, block %s, queue depth %u, "
      "threads %u, aio backend %s; GB/s = 1e9 B/s\n",
      format_size(file_size).c_str(), format_size(opt.block_size).c_str(), opt.queue_depth,
      opt.thread_count, describe_backend(backend).c_str());
  std::printf("%-6s %-5s %9s %9s %7s | %9s %9s %7s\n", "round", "dir", "ours GB/s", "fio GB/s",
              "ratio", "ours cpu", "fio cpu", "ratio");
  std::vector<double> ours[2], fio[2], cpu_ours[2], cpu_fio[2];
  for (int round = 0; round < a.repeat && !stop_requested(); ++round) {
    for (int dir : {1, 0}) {  // writes first: reads then find freshly written blocks
      Workload w{.write = dir == 1,
                 .file_size = file_size,
                 .seconds = 0,
                 .register_buffer = !a.no_register};
      Result r_ours, r_fio;
      bool ours_first = round % 2 == 0;
      for (int turn = 0; turn < 2 && !stop_requested(); ++turn) {
        bool ours_now = (turn == 0) == ours_first;
        std::fprintf(stderr, "bench_aio: round %d/%d, %s, %s...\n", round + 1, a.repeat,
                     dir ? "write" : "read", ours_now ? "ours" : "fio");
        if (ours_now) {
          r_ours = measure_engine(scratch.file(), buf, opt, w, stop_requested);
        } else {
          r_fio = measure_fio(scratch.path(), opt, w, stop_requested);
        }
      }
      if (stop_requested() || r_ours.stopped || r_fio.stopped) break;
      if (r_fio.gbps <= 0 || r_fio.bytes == 0 || r_ours.bytes == 0) {
        throw Error("fio reported no bandwidth; cannot form a ratio");
      }
      // CPU milliseconds per GiB moved: robust where wall time is noisy (shared machine).
      double gib = double(1 << 30);
      ours[dir].push_back(r_ours.gbps);
      fio[dir].push_back(r_fio.gbps);
      cpu_ours[dir].push_back(r_ours.cpu_seconds * 1000 / (double(r_ours.bytes) / gib));
      cpu_fio[dir].push_back(r_fio.cpu_seconds * 1000 / (double(r_fio.bytes) / gib));
      std::printf("%-6d %-5s %9.3f %9.3f %7.3f | %9.1f %9.1f %7.3f\n", round + 1,
                  dir ? "write" : "read", r_ours.gbps, r_fio.gbps, r_ours.gbps / r_fio.gbps,
                  cpu_ours[dir].back(), cpu_fio[dir].back(),
                  cpu_fio[dir].back() / cpu_ours[dir].back());
      std::fflush(stdout);
    }
  }
  if (stop_requested()) {
    std::fprintf(stderr, "bench_aio: interrupted; %s removed\n", scratch.path().c_str());
    return 130;
  }
  std::printf(
      "\nmedians. GB/s ratio = ours / fio (goal >= 0.95); cpu = CPU ms per GiB moved, "
      "ratio = fio / ours (>= 1: ours no costlier)\n");
  std::printf("%-6s %9s %9s %7s %13s | %9s %9s %7s\n", "dir", "ours GB/s", "fio GB/s", "ratio",
              "pair min..max", "ours cpu", "fio cpu", "ratio");
  for (int dir : {1, 0}) {
    std::vector<double> pair;
    for (size_t i = 0; i < ours[dir].size(); ++i) pair.push_back(ours[dir][i] / fio[dir][i]);
    auto [lo, hi] = std::minmax_element(pair.begin(), pair.end());
    std::printf("%-6s %9.3f %9.3f %7.3f %6.3f..%.3f | %9.1f %9.1f %7.3f\n", dir ? "write" : "read",
                median(ours[dir]), median(fio[dir]), median(ours[dir]) / median(fio[dir]), *lo, *hi,
                median(cpu_ours[dir]), median(cpu_fio[dir]),
                median(cpu_fio[dir]) / median(cpu_ours[dir]));
  }
  return 0;
}

}  // namespace
}  // namespace outcore::aio_bench

int main(int argc, char** argv) {
  using namespace outcore::aio_bench;
  outcore::log::init("warn");
  outcore::tools::apply_environment_settings();
  Args a;
  CLI::App app{"bench_aio: sequential read/write through the aio engine vs fio, same file"};
  app.add_option("--path", a.path, "directory on the drive to test")->required();
  app.add_option("--file-size", a.file_size, "file size (default 4G)");
  app.add_option("--block-size", a.block_size, "request size (default 1M)");
  app.add_option("--queue-depth", a.queue_depth, "requests in flight (default 32)");
  app.add_option("--threads", a.threads, "I/O threads / fio jobs (default 1)");
  app.add_option("--repeat", a.repeat, "rounds (default 5)");
  app.add_option("--io-size", a.io_size, "engine buffer, streamed as 4 spans (default 128M)");
  app.add_flag("--no-register", a.no_register, "do not register the buffer with the kernel");
  return parse_and_run(app, "bench_aio", argc, argv, [&] { return run(a); });
}
