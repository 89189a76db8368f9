// Cost of one OUTCORE_TRACE_SPAN with tracing off and on, against an empty loop measured in the
// same run. Usage: trace_bench [spans] (default 10^8 off, spans / 100 on).
#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "common/trace.hpp"

namespace {

using Clock = std::chrono::steady_clock;

double ns_per_iter(Clock::time_point t0, long n) {
  return std::chrono::duration<double, std::nano>(Clock::now() - t0).count() / double(n);
}

double empty_loop(long n) {
  const Clock::time_point t0 = Clock::now();
  for (long i = 0; i < n; ++i) asm volatile("" ::: "memory");
  return ns_per_iter(t0, n);
}

double span_loop(long n) {
  const Clock::time_point t0 = Clock::now();
  for (long i = 0; i < n; ++i) {
    OUTCORE_TRACE_SPAN("span", "bench", {.index = static_cast<int32_t>(i)});
    asm volatile("" ::: "memory");
  }
  return ns_per_iter(t0, n);
}

}  // namespace

int main(int argc, char** argv) {
  const long n = argc > 1 ? std::atol(argv[1]) : 100000000L;
  if (n < 100) {
    std::fprintf(stderr, "usage: trace_bench [spans >= 100]\n");
    return 2;
  }
  const double base = empty_loop(n);
  const double off = span_loop(n);
  outcore::trace::start();
  const double on = span_loop(n / 100);
  outcore::trace::stop();
  std::printf("empty loop        %.2f ns/iter\n", base);
  std::printf("span, tracing off %.2f ns/iter (%.2f ns over the empty loop)\n", off, off - base);
  std::printf("span, tracing on  %.2f ns/iter (%zu spans recorded)\n", on,
              outcore::trace::event_count());
  return 0;
}
