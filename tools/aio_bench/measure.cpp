// measure_engine: stream a file through the aio engine with 4 spans in flight.
#include "tools/aio_bench/measure.hpp"

#include <sys/resource.h>

#include <array>
#include <chrono>

namespace outcore::aio_bench {
namespace {

double cpu_seconds_self() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  auto sec = [](const timeval& t) { return double(t.tv_sec) + double(t.tv_usec) / 1e6; };
  return sec(ru.ru_utime) + sec(ru.ru_stime);
}

}  // namespace

Result measure_engine(const aio::File& file, std::span<std::byte> buffer, const aio::Options& opt,
                      const Workload& w, const StopFn& stop) {
  constexpr int kSpans = 4;
  uint64_t span = buffer.size() / kSpans / kIoAlignment * kIoAlignment;
  uint64_t positions = w.file_size / span;
  if (span == 0 || positions == 0) {
    throw InvalidArgument("aio_bench: the file is smaller than one I/O span");
  }
  aio::Engine engine(opt);
  if (w.register_buffer) {
    std::span<std::byte> bufs[] = {buffer};
    engine.register_buffers(bufs);
  }
  std::array<aio::Ticket, kSpans> tickets;
  uint64_t next = 0;  // next span position in the file
  auto submit = [&](int slot) {
    uint64_t off = (next++ % positions) * span;
    auto part = buffer.subspan(slot * span, span);
    tickets[slot] =
        w.write ? engine.submit_write(file, off, part) : engine.submit_read(file, off, part);
  };
  uint64_t total_spans = w.seconds > 0 ? UINT64_MAX : positions;
  Result r;
  double cpu0 = cpu_seconds_self();
  auto t0 = std::chrono::steady_clock::now();
  auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  for (int s = 0; s < kSpans && next < total_spans; ++s) submit(s);
  uint64_t done = 0;
  try {
    for (int s = 0; done < next; s = (s + 1) % kSpans) {
      engine.wait(tickets[s]);
      tickets[s] = {};
      r.bytes += span;
      ++done;
      if (stop && stop()) r.stopped = true;
      bool more = w.seconds > 0 ? elapsed() < w.seconds : next < total_spans;
      if (more && !r.stopped) submit(s);
    }
  } catch (...) {
    engine.wait_all();  // never leave requests running on the caller's buffer
    throw;
  }
  r.seconds = elapsed();
  r.cpu_seconds = cpu_seconds_self() - cpu0;
  r.gbps = r.seconds > 0 ? double(r.bytes) / r.seconds / 1e9 : 0;
  aio::Stats st = engine.stats();
  const aio::LatencyHistogram& h = w.write ? st.write.latency : st.read.latency;
  r.p50_us = h.percentile_us(0.5);
  r.p99_us = h.percentile_us(0.99);
  return r;
}

}  // namespace outcore::aio_bench
