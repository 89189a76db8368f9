// The CPU's bf16 GEMM (engine/device/cpu/bf16_gemm.hpp) against the exact sum of its products,
// on every transposition, dense and strided leading dimensions, alpha and beta, at shapes that
// reach oneDNN's small-matrix, AMX and split-K kernels; and the choice between oneDNN and widening
// for sgemm. The fp32 GEMM on one thread (gemm_f32_serial) likewise. ctest runs this file twice: as
// this CPU is, and with ONEDNN_MAX_CPU_ISA=AVX512_CORE (no bf16 dot products), where the GEMM must
// be the sgemm of the widened operands, bit for bit.
#include "engine/device/cpu/bf16_gemm.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "common/dtype.hpp"
#include "engine/device/cpu/kernels.hpp"
#include "tests/common/numeric.hpp"

namespace outcore::device::cpu {
namespace {

using outcore::test::randn;

// Whether gemm_bf16 must run on oneDNN here: the CPU has bf16 dot products and ONEDNN_MAX_CPU_ISA
// does not cap oneDNN below them.
bool expect_onednn() {
  if (!__builtin_cpu_supports("avx512bf16")) return false;
  const char* cap = std::getenv("ONEDNN_MAX_CPU_ISA");
  if (cap == nullptr) return true;
  const std::string c = cap;
  return c == "ALL" || c.find("BF16") != std::string::npos || c.find("AMX") != std::string::npos;
}

std::vector<uint16_t> bf16_randn(size_t n, uint32_t seed) {
  const auto f = randn(n, seed);
  std::vector<uint16_t> b(n);
  from_fp32(f.data(), b.data(), DType::BF16, static_cast<int64_t>(n));
  return b;
}

std::vector<float> widened(const std::vector<uint16_t>& b) {
  std::vector<float> f(b.size());
  to_fp32(b.data(), DType::BF16, f.data(), static_cast<int64_t>(b.size()));
  return f;
}

struct Case {
  int64_t m, n, k;
};

// Every result within the bound of any fp32 summation order of the products: (k + 2) units of
// rounding (2^-24) of alpha * sum |a b| + |beta c|, against the fp64 sum. f32: gemm_f32_serial on
// fp32 operands (each product rounded once more), else gemm_bf16.
void check_case(const Case& cs, int64_t pad, bool ta, bool tb, float alpha, float beta,
                bool f32 = false) {
  const int64_t m = cs.m, n = cs.n, k = cs.k;
  // Each stored row `pad` elements longer than the GEMM reads (dense, or strided as a head's
  // columns of q, k and v are).
  const int64_t lda = (ta ? m : k) + pad, ldb = (tb ? k : n) + pad, ldc = n + pad;
  const auto a = bf16_randn(static_cast<size_t>((ta ? k : m) * lda), 41);
  const auto b = bf16_randn(static_cast<size_t>((tb ? n : k) * ldb), 42);
  const auto wa = f32 ? randn(a.size(), 44) : widened(a),
             wb = f32 ? randn(b.size(), 45) : widened(b);
  auto c = randn(static_cast<size_t>(m * ldc), 43);
  if (beta == 0.0f) c[0] = std::numeric_limits<float>::quiet_NaN();  // ignored
  const auto c0 = c;
  if (f32)
    gemm_f32_serial(ta, tb, m, n, k, alpha, wa.data(), lda, wb.data(), ldb, beta, c.data(), ldc);
  else
    gemm_bf16(ta, tb, m, n, k, alpha, a.data(), lda, b.data(), ldb, beta, c.data(), ldc);

  const std::string what = std::string(f32 ? "fp32 " : "bf16 ") + "m=" + std::to_string(m) +
                           " n=" + std::to_string(n) + " k=" + std::to_string(k) +
                           " pad=" + std::to_string(pad) + " ta=" + std::to_string(ta) +
                           " tb=" + std::to_string(tb) + " alpha=" + std::to_string(alpha) +
                           " beta=" + std::to_string(beta);
  int64_t outside = 0;
  double worst = 0.0;
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double sum = 0.0, mag = 0.0;
      for (int64_t p = 0; p < k; ++p) {
        const double x = wa[ta ? p * lda + i : i * lda + p], y = wb[tb ? j * ldb + p : p * ldb + j];
        sum += x * y;
        mag += std::abs(x * y);
      }
      const double old = beta == 0.0f ? 0.0 : double(beta) * c0[i * ldc + j];
      const double want = double(alpha) * sum + old;
      const double bound =
          double(k + 2 + f32) * 0x1p-24 * (std::abs(double(alpha)) * mag + std::abs(old));
      const double err = std::abs(double(c[i * ldc + j]) - want);
      worst = std::max(worst, bound > 0.0 ? err / bound : err);
      outside += !(err <= bound);
    }
    // The columns past n are C's own, untouched.
    for (int64_t j = n; j < ldc; ++j)
      ASSERT_EQ(std::bit_cast<uint32_t>(c[i * ldc + j]), std::bit_cast<uint32_t>(c0[i * ldc + j]))
          << what << " wrote past its columns at row " << i;
  }
  EXPECT_EQ(outside, 0) << what << ": worst error " << worst << " of the bound";

  // Where it widens, it is the sgemm of the widened operands, bit for bit.
  if (!f32 && !expect_onednn()) {
    auto want = c0;
    gemm(ta, tb, m, n, k, alpha, wa.data(), lda, wb.data(), ldb, beta, want.data(), ldc);
    for (size_t i = 0; i < want.size(); ++i)
      ASSERT_EQ(std::bit_cast<uint32_t>(c[i]), std::bit_cast<uint32_t>(want[i]))
          << what << ": not the sgemm of the widened operands at " << i;
  }
}

TEST(Bf16Gemm, IsTheExactProductsSumUpToSummationOrder) {
  for (const Case cs :
       {Case{13, 21, 37}, Case{64, 96, 128}, Case{256, 192, 512}, Case{48, 40, 4096}})
    for (const int64_t pad : {0, 3})
      for (const bool ta : {false, true})
        for (const bool tb : {false, true})
          for (const auto& [alpha, beta] : {std::pair{1.0f, 0.0f}, {0.125f, 1.0f}, {0.5f, 2.0f}})
            check_case(cs, pad, ta, tb, alpha, beta);
}

// fp32 on the calling thread, at attention's block shapes among others.
TEST(Bf16Gemm, Fp32OnOneThreadIsTheProductsSumUpToSummationOrder) {
  for (const Case cs :
       {Case{13, 21, 37}, Case{128, 300, 64}, Case{128, 64, 300}, Case{48, 40, 2048}})
    for (const int64_t pad : {0, 3})
      for (const bool ta : {false, true})
        for (const bool tb : {false, true})
          for (const auto& [alpha, beta] : {std::pair{1.0f, 0.0f}, {0.125f, 1.0f}, {0.5f, 2.0f}})
            check_case(cs, pad, ta, tb, alpha, beta, true);
}

// k == 0: C = beta * C; m or n == 0: nothing to do.
TEST(Bf16Gemm, EmptyProductsLeaveBetaTimesC) {
  std::vector<uint16_t> a(8), b(8);
  std::vector<float> c{1.0f, -2.0f, 3.0f, 4.0f};
  gemm_bf16(false, false, 2, 2, 0, 1.0f, a.data(), 1, b.data(), 2, 2.0f, c.data(), 2);
  EXPECT_EQ(c, (std::vector<float>{2.0f, -4.0f, 6.0f, 8.0f}));
  gemm_bf16(false, false, 0, 2, 3, 1.0f, a.data(), 3, b.data(), 2, 0.0f, c.data(), 2);
  gemm_bf16(false, false, 2, 0, 3, 1.0f, a.data(), 3, b.data(), 1, 0.0f, c.data(), 1);
  EXPECT_EQ(c, (std::vector<float>{2.0f, -4.0f, 6.0f, 8.0f}));
  const std::vector<float> fa(8), fb(8);
  gemm_f32_serial(false, false, 2, 2, 0, 1.0f, fa.data(), 1, fb.data(), 2, 0.5f, c.data(), 2);
  gemm_f32_serial(false, false, 0, 2, 3, 1.0f, fa.data(), 3, fb.data(), 2, 0.0f, c.data(), 2);
  EXPECT_EQ(c, (std::vector<float>{1.0f, -2.0f, 3.0f, 4.0f}));
}

// The same call, the same bits (a compiled kernel is reused from the cache).
TEST(Bf16Gemm, RepeatsItsBits) {
  const int64_t m = 128, n = 160, k = 1024;
  const auto a = bf16_randn(m * k, 51), b = bf16_randn(n * k, 52);
  std::vector<float> c1(m * n), c2(m * n);
  gemm_bf16(false, true, m, n, k, 1.0f, a.data(), k, b.data(), k, 0.0f, c1.data(), n);
  gemm_bf16(false, true, m, n, k, 1.0f, a.data(), k, b.data(), k, 0.0f, c2.data(), n);
  for (size_t i = 0; i < c1.size(); ++i)
    ASSERT_EQ(std::bit_cast<uint32_t>(c1[i]), std::bit_cast<uint32_t>(c2[i])) << i;
}

// oneDNN where the CPU has bf16 dot products (and ONEDNN_MAX_CPU_ISA allows them), else widened.
TEST(Bf16Gemm, RunsOnOneDnnExactlyWhereTheCpuMultipliesBf16) {
  const std::string path = bf16_gemm_path();
  if (expect_onednn()) {
    EXPECT_TRUE(path.starts_with("oneDNN ")) << path;
    EXPECT_EQ(path.find("ref"), std::string::npos) << path;
  } else {
    EXPECT_EQ(path, "widened to fp32, OpenBLAS sgemm");
  }
}

// Threads running the same shapes at once (the CPU backend's attention runs its kv heads so) each
// get the bits of one thread alone: no scratch of one run is another's. bf16 and fp32.
TEST(Bf16Gemm, ThreadsRunTheSameShapesAtOnce) {
  // NT, NN and TN (attention's scores, products with v, and dk / dv), each with its scratch.
  const int64_t m = 256, n = 64, k = 128;
  const auto a = bf16_randn(m * k, 61), b = bf16_randn(k * std::max(m, n), 62);
  const auto fa = randn(m * k, 63), fb = randn(k * std::max(m, n), 64);
  struct Call {
    bool ta, tb;
    int64_t lda, ldb;
    float alpha, beta;
    bool f32;
  };
  const Call calls[] = {{false, true, k, k, 1.0f, 0.0f, false},
                        {false, false, k, n, 0.5f, 0.0f, false},
                        {true, false, m, n, 0.125f, 1.0f, false},
                        {false, true, k, k, 1.0f, 0.0f, true},
                        {true, false, m, n, 0.125f, 1.0f, true}};
  const int kinds = static_cast<int>(std::size(calls));
  auto run = [&](const Call& c, std::vector<float>& out) {
    std::fill(out.begin(), out.end(), 1.0f);
    if (c.f32)
      gemm_f32_serial(c.ta, c.tb, m, n, k, c.alpha, fa.data(), c.lda, fb.data(), c.ldb, c.beta,
                      out.data(), n);
    else
      gemm_bf16(c.ta, c.tb, m, n, k, c.alpha, a.data(), c.lda, b.data(), c.ldb, c.beta, out.data(),
                n);
  };
  std::vector<std::vector<float>> want(kinds, std::vector<float>(m * n));
  for (int i = 0; i < kinds; ++i) run(calls[i], want[i]);
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::vector<float> c(m * n);
      for (int r = 0; r < 60; ++r) {
        const int i = (r + t) % kinds;
        run(calls[i], c);
        if (std::memcmp(c.data(), want[i].data(), c.size() * sizeof(float)) != 0) ++wrong;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(wrong.load(), 0) << "runs of 240 that differ from one thread alone";
}

// The threads a program sets, and 0 for OpenMP's default again.
TEST(Bf16Gemm, ThreadsAreTheProgramsOrOpenMpsDefault) {
  const int by_default = bf16_gemm_threads();
  ASSERT_GE(by_default, 1);
  set_bf16_gemm_threads(5);
  EXPECT_EQ(bf16_gemm_threads(), 5);
  set_bf16_gemm_threads(0);
  EXPECT_EQ(bf16_gemm_threads(), by_default);
}

}  // namespace
}  // namespace outcore::device::cpu
