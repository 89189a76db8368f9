// Measuring sequential throughput of the aio engine and of fio on one file.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>

#include "aio/aio.hpp"

namespace outcore::aio_bench {

// Polled between requests; true stops the measurement early (Ctrl-C).
using StopFn = std::function<bool()>;

struct Result {
  double gbps = 0;  // 1e9 bytes per second
  uint64_t bytes = 0;
  double seconds = 0;
  uint64_t p50_us = 0;  // per request (one block), submission to completion
  uint64_t p99_us = 0;
  double cpu_seconds = 0;  // user + system CPU of the process doing the I/O (its io_uring
                           // kernel workers included), a noise-robust cost measure
  bool stopped = false;    // cut short by StopFn
};

struct Workload {
  bool write = false;
  uint64_t file_size = 0;  // bytes of the file covered, sequentially, wrapping around
  double seconds = 0;      // > 0: run this long; 0: one pass over file_size
  bool register_buffer = true;
};

// Runs `w` with an Engine built from `opt` over `file`, streaming through `buffer` as 4 spans
// kept in flight (like a swapper's buffers). The buffer size must be a multiple of 16 KiB.
// Throws IoError / InvalidArgument from the engine.
Result measure_engine(const aio::File& file, std::span<std::byte> buffer, const aio::Options& opt,
                      const Workload& w, const StopFn& stop);

// Whether `fio` can be run (found on PATH and answers --version).
bool fio_available();

// Runs fio (ioengine=io_uring, direct=1) with the same block size, depth, jobs (= threads,
// each on its own slice of the file), batching (single_submit -> iodepth_batch_submit=1) and
// completion (overlap_events=false -> iodepth_batch_complete_min=queue_depth) on `path`.
// fio's output goes to a directory of its own made under the system's temporary directory
// (removed afterwards), never beside `path`. Throws outcore::Error naming fio's own message
// when it fails; a stopped run returns Result{.stopped = true}.
Result measure_fio(const std::string& path, const aio::Options& opt, const Workload& w,
                   const StopFn& stop);

}  // namespace outcore::aio_bench
