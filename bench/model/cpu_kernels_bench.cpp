// The CPU backend's row and column kernels on oneTBB's threads against the host kernels they
// run in ranges (device::cpu, one thread), measured in the same run at a decoder's shapes:
// RMSNorm's backward (rows, then columns), RoPE, SwiGLU's backward, the embedding's backward
// (columns, repeated ids) and the bf16 cast. Each is timed cold: a 64 MiB pass over other memory
// before every run, so the operands come from DRAM as in a training step. The results are the
// same bits (BackendConformance.*InRangesHaveTheHostsBits); this measures only the time.
//
//   cpu_kernels_bench [--tokens 2048] [--hidden 4096] [--intermediate 14336] [--heads 32]
//                     [--head-dim 128] [--vocab 32000] [--reps 10] [--threads N]
//
// Prints one line per kernel: host ms, backend ms, and host / backend (above 1: the threads
// gain).
#include <fmt/format.h>
#include <tbb/global_control.h>
#include <tbb/task_arena.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "common/dtype.hpp"
#include "engine/device/compute_backend.hpp"
#include "engine/device/cpu/kernels.hpp"
#include "engine/device/device.hpp"

namespace {

using namespace outcore;
using Clock = std::chrono::steady_clock;

std::vector<float> normal_values(size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

// Best milliseconds of `reps` cold runs of `body` (after one warm-up).
double best_cold_ms(int reps, const std::function<void()>& body) {
  static std::vector<float> other(size_t{16} << 20);  // 64 MiB, larger than the caches
  double best = 1e30;
  for (int r = 0; r <= reps; ++r) {
    for (float& x : other) x += 1.0f;
    const auto t0 = Clock::now();
    body();
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    if (r > 0) best = std::min(best, ms);
  }
  return best;
}

void report(const std::string& name, double host_ms, double backend_ms) {
  std::printf("%-36s host %9.3f ms  backend %9.3f ms  host / backend %.2f\n", name.c_str(), host_ms,
              backend_ms, host_ms / backend_ms);
}

}  // namespace

int main(int argc, char** argv) {
  int64_t tokens = 2048, hidden = 4096, intermediate = 14336, heads = 32, head_dim = 128,
          vocab = 32000;
  int reps = 10, threads = 0;
  CLI::App app{"The CPU backend's row and column kernels on its threads vs the host kernels"};
  app.add_option("--tokens", tokens, "rows (tokens of a micro-batch)")->check(CLI::PositiveNumber);
  app.add_option("--hidden", hidden, "hidden size")->check(CLI::PositiveNumber);
  app.add_option("--intermediate", intermediate, "MLP size")->check(CLI::PositiveNumber);
  app.add_option("--heads", heads, "query heads (RoPE)")->check(CLI::PositiveNumber);
  app.add_option("--head-dim", head_dim, "head size (RoPE; even)")->check(CLI::PositiveNumber);
  app.add_option("--vocab", vocab, "embedding rows")->check(CLI::PositiveNumber);
  app.add_option("--reps", reps, "timed runs of each kernel (best kept)")
      ->check(CLI::PositiveNumber);
  app.add_option("--threads", threads, "the backend's threads (default: every processor)")
      ->check(CLI::NonNegativeNumber);
  CLI11_PARSE(app, argc, argv);
  if (head_dim % 2 != 0) {
    std::fprintf(stderr, "error: --head-dim %lld: RoPE needs an even head size\n",
                 static_cast<long long>(head_dim));
    return 2;
  }
  std::optional<tbb::global_control> limit;
  if (threads > 0) limit.emplace(tbb::global_control::max_allowed_parallelism, threads);

  device::CpuDevice dev;
  const auto backend = device::make_cpu_backend(dev);
  device::ComputeBackend& be = *backend;
  std::printf(
      "cpu kernels: %lld tokens, hidden %lld, intermediate %lld, %lld heads of %lld, "
      "vocabulary %lld; backend threads %d\n",
      static_cast<long long>(tokens), static_cast<long long>(hidden),
      static_cast<long long>(intermediate), static_cast<long long>(heads),
      static_cast<long long>(head_dim), static_cast<long long>(vocab),
      threads > 0 ? threads : tbb::this_task_arena::max_concurrency());

  const int64_t th = tokens * hidden;
  {  // RMSNorm backward
    const auto dy = normal_values(th, 1), x = normal_values(th, 2), w = normal_values(hidden, 3),
               rstd = normal_values(tokens, 4);
    std::vector<float> dx(th), dw(hidden);
    const double host = best_cold_ms(reps, [&] {
      device::cpu::rmsnorm_backward(dy.data(), x.data(), w.data(), rstd.data(), tokens, hidden,
                                    dx.data(), dw.data());
    });
    const double ours = best_cold_ms(reps, [&] {
      be.rmsnorm_backward(dy.data(), x.data(), w.data(), rstd.data(), tokens, hidden, dx.data(),
                          dw.data());
    });
    report(fmt::format("rmsnorm_backward {}x{}", tokens, hidden), host, ours);
  }
  {  // RoPE on q, with its bf16 output
    const int64_t width = heads * head_dim;
    auto x = normal_values(tokens * width, 5);
    const auto c = normal_values(tokens * head_dim / 2, 6),
               s = normal_values(tokens * head_dim / 2, 7);
    std::vector<uint16_t> x16(x.size());
    const double host = best_cold_ms(reps, [&] {
      device::cpu::rope(x.data(), tokens, tokens, heads, head_dim, c.data(), s.data(), false,
                        x16.data());
    });
    const double ours = best_cold_ms(reps, [&] {
      be.rope(x.data(), tokens, tokens, heads, head_dim, c.data(), s.data(), false, x16.data());
    });
    report(fmt::format("rope {}x{}x{} (+bf16)", tokens, heads, head_dim), host, ours);
  }
  {  // SwiGLU backward with bf16 outputs
    const int64_t n = tokens * intermediate;
    const auto da = normal_values(n, 8), g = normal_values(n, 9), u = normal_values(n, 10);
    std::vector<uint16_t> dg16(n), du16(n);
    const double host = best_cold_ms(reps, [&] {
      device::cpu::swiglu_backward(da.data(), g.data(), u.data(), nullptr, nullptr, n, dg16.data(),
                                   du16.data());
    });
    const double ours = best_cold_ms(reps, [&] {
      be.swiglu_backward(da.data(), g.data(), u.data(), nullptr, nullptr, n, dg16.data(),
                         du16.data());
    });
    report(fmt::format("swiglu_backward {}x{} (bf16)", tokens, intermediate), host, ours);
  }
  {  // embedding backward: ids with repeats, as text has
    const auto dy = normal_values(th, 11);
    std::vector<int32_t> ids(tokens);
    std::mt19937 rng(12);
    for (auto& id : ids) id = static_cast<int32_t>(rng() % std::min<int64_t>(vocab, 1000));
    std::vector<float> grad(static_cast<size_t>(vocab * hidden));
    const double host = best_cold_ms(reps, [&] {
      for (int64_t i = 0; i < tokens; ++i)
        device::cpu::add_inplace(grad.data() + int64_t{ids[i]} * hidden, dy.data() + i * hidden,
                                 hidden);
    });
    const double ours = best_cold_ms(
        reps, [&] { be.embedding_backward(ids.data(), dy.data(), tokens, hidden, grad.data()); });
    report(fmt::format("embedding_backward {}x{}", tokens, hidden), host, ours);
  }
  {  // the bf16 cast of an activation
    const auto x = normal_values(th, 13);
    std::vector<uint16_t> x16(th);
    const double host =
        best_cold_ms(reps, [&] { device::cpu::from_fp32(x.data(), x16.data(), DType::BF16, th); });
    const double ours =
        best_cold_ms(reps, [&] { be.from_fp32(x.data(), x16.data(), DType::BF16, th); });
    report(fmt::format("from_fp32 bf16 {}x{}", tokens, hidden), host, ours);
  }
  return 0;
}
