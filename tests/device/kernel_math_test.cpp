// The shared host/device arithmetic (engine/device/kernel_math.hpp) against the host kernels
// that call it (engine/device/cpu/kernels.cpp) and the host dtype conversions: bit for bit, in both
// the kernels' vector bodies and their scalar tails. The CUDA kernels run the same functions, so
// these tests pin their per-element arithmetic on machines without a GPU.
#include "engine/device/kernel_math.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "common/dtype.hpp"
#include "cpu_adam/cpu_adam.hpp"
#include "engine/device/cpu/kernels.hpp"
#include "engine/device/cuda/cuda_kernels.hpp"
#include "engine/device/rmsnorm_dw_split.hpp"
#include "tests/common/numeric.hpp"

namespace outcore::device {
namespace {

using outcore::test::randn;

// Same value, or both NaN.
::testing::AssertionResult SameBits(float a, float b) {
  if (std::isnan(a) && std::isnan(b)) return ::testing::AssertionSuccess();
  if (kmath::float_bits(a) == kmath::float_bits(b)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << a << " != " << b << " (bits " << std::hex << kmath::float_bits(a) << " vs "
         << kmath::float_bits(b) << ")";
}

// The sum the host kernels form for a reduction in 8 fp32 lanes (element i into lane i % 8,
// lanes folded 4+4, 2+2, 1+1), then the scalar tail in order.
float lane8_sum(const std::vector<float>& terms) {
  float lane[8] = {};
  const size_t body = terms.size() / 8 * 8;
  for (size_t i = 0; i < body; ++i) lane[i % 8] += terms[i];
  float four[4], two[2];
  for (int l = 0; l < 4; ++l) four[l] = lane[l] + lane[l + 4];
  for (int l = 0; l < 2; ++l) two[l] = four[l] + four[l + 2];
  float s = two[0] + two[1];
  for (size_t i = body; i < terms.size(); ++i) s += terms[i];
  return s;
}

// Inputs across exp's whole range, its clamps and the special values.
std::vector<float> exp_inputs() {
  std::vector<float> x = randn(4096, 1, 30.0f);
  for (float v : {0.0f, -0.0f, 1.0f, -1.0f, 88.7f, 88.8f, -87.6f, -87.7f, -88.5f, -100.0f, 500.0f,
                  std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::quiet_NaN(), 1e-30f, -1e-30f})
    x.push_back(v);
  while (x.size() % 8 != 0) x.push_back(0.5f);
  return x;
}

// The attention's D taken a word (two bf16 values) at a time, as a GPU kernel loads it, is the
// row's sum in the same order: the same bits.
TEST(KernelMath, Bf16RowDotByPairsIsTheSameSum) {
  const int64_t n = 136;
  std::vector<uint16_t> a(n), b(n);
  const auto x = randn(n, 61), y = randn(n, 62, 100.0f);
  cpu::from_fp32(x.data(), a.data(), DType::BF16, n);
  cpu::from_fp32(y.data(), b.data(), DType::BF16, n);
  float sum = 0.0f;
  for (int64_t i = 0; i < n; i += 2)
    sum = kmath::bf16_row_dot_pair(sum, uint32_t{a[i]} | uint32_t{a[i + 1]} << 16,
                                   uint32_t{b[i]} | uint32_t{b[i + 1]} << 16);
  EXPECT_EQ(std::bit_cast<uint32_t>(sum),
            std::bit_cast<uint32_t>(kmath::bf16_row_dot(a.data(), b.data(), n)));
  float backwards = 0.0f;  // another order differs: the test can tell orders apart
  for (int64_t i = n - 1; i >= 0; --i)
    backwards += kmath::bf16_to_fp32(a[i]) * kmath::bf16_to_fp32(b[i]);
  EXPECT_NE(std::bit_cast<uint32_t>(backwards), std::bit_cast<uint32_t>(sum));
}

TEST(KernelMath, ExpFastEqualsTheVectorKernelLaneForLane) {
  const std::vector<float> x = exp_inputs();
  std::vector<float> vec = x;
  cpu::exp_inplace(vec.data(), static_cast<int64_t>(vec.size()));  // all in 8-lane body
  for (size_t i = 0; i < x.size(); ++i)
    EXPECT_TRUE(SameBits(kmath::exp_fast(x[i]), vec[i])) << x[i];
  EXPECT_EQ(kmath::exp_fast(-std::numeric_limits<float>::infinity()), 0.0f);
  EXPECT_TRUE(std::isinf(kmath::exp_fast(500.0f)));
  EXPECT_NEAR(kmath::exp_fast(1.0f), std::exp(1.0f), 3e-7f);
}

TEST(KernelMath, SwigluForwardAndGradientEqualTheKernelInBodyAndTail) {
  const int64_t n = 8 * 64 + 5;  // a vector body and a scalar tail
  auto g = randn(n, 2, 4.0f), u = randn(n, 3), da = randn(n, 4);
  std::vector<float> a(n), dg(n), du(n);
  cpu::swiglu_forward(g.data(), u.data(), a.data(), n);
  cpu::swiglu_backward(da.data(), g.data(), u.data(), dg.data(), du.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    float edg, edu;
    kmath::swiglu_grad(da[i], g[i], u[i], edg, edu);
    ASSERT_TRUE(SameBits(kmath::swiglu(g[i], u[i]), a[i])) << i;
    ASSERT_TRUE(SameBits(edg, dg[i])) << i;
    ASSERT_TRUE(SameBits(edu, du[i])) << i;
  }
  // And against the definition.
  const double s = 1.0 / (1.0 + std::exp(-double(g[7])));
  EXPECT_NEAR(a[7], g[7] * s * u[7], 1e-5);
  EXPECT_NEAR(du[7], da[7] * g[7] * s, 1e-5);
  EXPECT_NEAR(dg[7], da[7] * u[7] * s * (1 + g[7] * (1 - s)), 1e-5);
}

TEST(KernelMath, RmsNormRowEqualsTheKernel) {
  const int64_t rows = 4, dim = 40;
  const float eps = 1e-5f;
  auto x = randn(rows * dim, 5), w = randn(dim, 6), dy = randn(rows * dim, 7);
  std::vector<float> y(rows * dim), rstd(rows), dx(rows * dim, 0.5f), dw(dim, 0.25f);
  cpu::rmsnorm_forward(x.data(), w.data(), eps, rows, dim, y.data(), rstd.data());
  cpu::rmsnorm_backward(dy.data(), x.data(), w.data(), rstd.data(), rows, dim, dx.data(),
                        dw.data());
  std::vector<float> edw(dim, 0.25f);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x.data() + r * dim;
    const float s = kmath::rmsnorm_rstd(cpu::sum_squares(xr, dim), dim, eps);
    ASSERT_TRUE(SameBits(s, rstd[r]));
    // The backward's row sum: lanes of fma(dy * w, x, acc).
    float lane[8] = {};
    for (int64_t i = 0; i < dim; ++i)
      lane[i % 8] = std::fma(dy[r * dim + i] * w[i], xr[i], lane[i % 8]);
    std::vector<float> folded(lane, lane + 8);
    const float coef = kmath::rmsnorm_grad_coef(s, lane8_sum(folded), dim);
    for (int64_t i = 0; i < dim; ++i) {
      ASSERT_TRUE(SameBits(kmath::rmsnorm_y(xr[i], w[i], s), y[r * dim + i]));
      const float edx = 0.5f + kmath::rmsnorm_dx(dy[r * dim + i], w[i], xr[i], s, coef);
      ASSERT_TRUE(SameBits(edx, dx[r * dim + i])) << r << " " << i;
      edw[i] += kmath::rmsnorm_dw(dy[r * dim + i], xr[i], s);
    }
  }
  for (int64_t i = 0; i < dim; ++i) EXPECT_TRUE(SameBits(edw[i], dw[i])) << i;
}

// The CUDA RMSNorm weight gradient's split (rmsnorm_dw_split.hpp): every row in exactly one
// range, no range empty, the ranges' partial sums within the fixed workspace, and a launch of
// about kDwTargetBlocks blocks where a hidden size's tiles alone are too few (a head's q/k norm).
TEST(KernelMath, RmsNormWeightGradientSplitCoversEveryRowOnceWithinItsWorkspace) {
  using namespace device::norm;
  for (int64_t rows : {1, 37, 511, 512, 513, 4096, 16384, 131072, 1 << 20})
    for (int64_t dim : {1, 32, 96, 128, 520, 4096, 8191, 8192, 16384}) {
      SCOPED_TRACE(std::to_string(rows) + " x " + std::to_string(dim));
      const DwSplit s = dw_split(rows, dim);
      ASSERT_EQ(s.tiles, (dim + 31) / 32);
      ASSERT_GE(s.ranges, 1);
      std::vector<int> seen(static_cast<size_t>(rows), 0);
      for (int64_t k = 0; k < s.ranges; ++k) {
        const RowRange r = dw_rows(k, s.rows_per_range, rows);
        ASSERT_LT(r.first, r.end) << "range " << k << " is empty";
        for (int64_t i = r.first; i < r.end; ++i) ++seen[static_cast<size_t>(i)];
      }
      ASSERT_TRUE(std::all_of(seen.begin(), seen.end(), [](int n) { return n == 1; }));
      if (s.ranges > 1) {
        EXPECT_LE(s.ranges * dim, kDwPartialFloats);
        EXPECT_GE(s.rows_per_range, kDwMinRows);
        EXPECT_LE(s.tiles * s.ranges, 2 * kDwTargetBlocks);
      }
    }
  // Qwen3 8B's q norm at 4096 tokens (32 heads of 128): 4 tiles over 64 ranges of 2048 rows.
  const DwSplit q = dw_split(4096 * 32, 128);
  EXPECT_EQ(q.tiles * q.ranges, 256);
  EXPECT_EQ(q.rows_per_range, 2048);
  // Llama 3 8B's hidden norms at 4096 tokens: 128 tiles over 2 ranges; 8192 columns: 1 range.
  EXPECT_EQ(dw_split(4096, 4096).ranges, 2);
  EXPECT_EQ(dw_split(4096, 8192).ranges, 1);
  // Rows too few to split: one range, dw written directly.
  EXPECT_EQ(dw_split(300, 128).ranges, 1);
}

// What cuBLASLt is told of an operand's alignment (cuda::Gemm): every batch entry's address
// counts, and 256 bytes (its default) is the most ever said.
TEST(KernelMath, GemmAlignmentIsThatOfEveryBatchEntryUpTo256Bytes) {
  using device::cuda::gemm_alignment;
  auto at = [](uintptr_t address) { return reinterpret_cast<const void*>(address); };
  EXPECT_EQ(gemm_alignment(at(4096)), 256u);
  EXPECT_EQ(gemm_alignment(at(4096 + 128)), 128u);
  EXPECT_EQ(gemm_alignment(at(4096 + 4)), 4u);
  EXPECT_EQ(gemm_alignment(at(4096 + 2)), 2u);
  EXPECT_EQ(gemm_alignment(at(4096 + 1)), 1u);
  // A batch: the stride counts too, and only when there is more than one entry.
  EXPECT_EQ(gemm_alignment(at(4096), 2, 64), 64u);
  EXPECT_EQ(gemm_alignment(at(4096), 3, 4097 * 4), 4u);
  EXPECT_EQ(gemm_alignment(at(4096), 1, 4), 256u);
  EXPECT_EQ(gemm_alignment(at(4096 + 32), 4, 1024), 32u);
}

TEST(KernelMath, RopeRotationEqualsTheKernelAndInverts) {
  const int64_t rows = 6, seq = 3, heads = 2, hd = 8, half = hd / 2;
  auto x = randn(rows * heads * hd, 8), c = randn(seq * half, 9), s = randn(seq * half, 10);
  for (bool inverse : {false, true}) {
    std::vector<float> y = x;
    cpu::rope(y.data(), rows, seq, heads, hd, c.data(), s.data(), inverse);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t h = 0; h < heads; ++h) {
        for (int64_t j = 0; j < half; ++j) {
          const int64_t at = (r * heads + h) * hd + j, t = (r % seq) * half + j;
          float x1, x2;
          kmath::rope_rotate(x[at], x[at + half], c[t], (inverse ? -1.0f : 1.0f) * s[t], x1, x2);
          ASSERT_TRUE(SameBits(x1, y[at]));
          ASSERT_TRUE(SameBits(x2, y[at + half]));
        }
      }
    }
  }
}

TEST(KernelMath, SoftmaxRowAndLogSumExpEqualTheKernel) {
  for (int64_t n : {1, 7, 8, 37, 64}) {
    auto x = randn(n, 11 + n, 3.0f);
    std::vector<float> p = x;
    const float lse = cpu::softmax_inplace(p.data(), n);
    const float m = cpu::max_value(x.data(), n);
    std::vector<float> e(n);
    for (int64_t j = 0; j < n; ++j) e[j] = kmath::softmax_exp(x[j], m);
    const float sum = lane8_sum(e);
    ASSERT_TRUE(SameBits(kmath::softmax_lse(m, sum), lse)) << n;
    ASSERT_TRUE(SameBits(cpu::log_sum_exp(x.data(), n), lse)) << n;
    for (int64_t j = 0; j < n; ++j) ASSERT_TRUE(SameBits(e[j] * (1.0f / sum), p[j])) << n << j;
    std::vector<float> shifted = x;
    cpu::exp_shift(shifted.data(), lse, n);
    for (int64_t j = 0; j < n; ++j)
      ASSERT_TRUE(SameBits(kmath::softmax_exp(x[j], lse), shifted[j]));
  }
  EXPECT_EQ(kmath::causal_keys(0), 1);
  EXPECT_EQ(kmath::causal_keys(9), 10);
}

// The GPU cross-entropy's one-pass max and sum: rows split into strided parts as a block's
// threads take them (each part's (m, s) online, then moved to the row's max and added) give the
// two-pass max exactly and its sum of exponentials within a few ulp per element (exp's rounding
// at each change of a part's max); NaN and infinite elements are what the two passes make of
// them, -inf elements count 0 wherever they come.
TEST(KernelMath, OnlineSoftmaxSumEqualsTheTwoPassSum) {
  const auto parts_sum = [](const std::vector<float>& x, int parts, float& row_max) {
    std::vector<float> m(parts, -INFINITY), s(parts, 0.0f);
    for (size_t j = 0; j < x.size(); ++j)
      kmath::softmax_online_add(x[j], m[j % parts], s[j % parts]);
    row_max = -INFINITY;
    for (int p = 0; p < parts; ++p) row_max = std::fmax(row_max, m[p]);
    double sum = 0;
    for (int p = 0; p < parts; ++p) sum += kmath::softmax_online_rescale(s[p], m[p], row_max);
    return sum;
  };
  for (int64_t n : {1, 5, 1000, 128256}) {
    for (int parts : {1, 3, 256}) {
      // Rising logits move every part's max at every element: the most rescaling.
      for (bool rising : {false, true}) {
        auto x = randn(n, 5 + n, 4.0f);
        if (rising) std::sort(x.begin(), x.end());
        const float m2 = *std::max_element(x.begin(), x.end());
        double want = 0;
        for (float v : x) want += kmath::softmax_exp(v, m2);
        float m1 = 0;
        const double got = parts_sum(x, parts, m1);
        ASSERT_TRUE(SameBits(m1, m2)) << n << " " << parts;
        EXPECT_NEAR(got, want, want * 1e-6 * std::sqrt(static_cast<double>(n)) + 1e-6)
            << n << " elements in " << parts << " parts, rising " << rising;
      }
    }
  }
  float m = 0;
  std::vector<float> x = {-INFINITY, 1.0f, -INFINITY, 2.0f};
  EXPECT_NEAR(parts_sum(x, 2, m), 1.0 + std::exp(-1.0), 1e-6);
  EXPECT_EQ(m, 2.0f);
  x = {-INFINITY, -INFINITY};  // all -inf: NaN, as the two passes' exp(-inf - -inf)
  EXPECT_TRUE(std::isnan(parts_sum(x, 1, m)));
  x = {1.0f, std::nanf(""), 2.0f};
  EXPECT_TRUE(std::isnan(parts_sum(x, 1, m)));
  EXPECT_TRUE(std::isnan(parts_sum(x, 2, m)));
  x = {1.0f, INFINITY, INFINITY};  // two +inf: exp(inf - inf), NaN, as in two passes
  EXPECT_TRUE(std::isnan(parts_sum(x, 1, m)));
}

// bf16 attention's numerators (decision 034): the host kernel's are exp(x - the shift) with the
// kernel's sum; and a numerator rounded to bf16 under one whole base-2 shift, then moved to a
// larger one by pow2_whole, is the numerator rounded under the larger shift: a kernel that raises
// its shift as it goes rounds as the host does.
TEST(KernelMath, SoftmaxNumeratorsMoveExactlyBetweenShifts) {
  for (int64_t n : {1, 7, 8, 37, 64}) {
    auto x = randn(n, 31 + n, 3.0f);
    std::vector<float> num = x;
    float inv = 0;
    const float lse = cpu::softmax_numerators(num.data(), n, &inv);
    const float m = kmath::bf16_softmax_shift(cpu::max_value(x.data(), n));
    std::vector<float> e(n);
    for (int64_t j = 0; j < n; ++j) e[j] = kmath::softmax_exp(x[j], m);
    const float sum = lane8_sum(e);
    ASSERT_TRUE(SameBits(kmath::softmax_lse(m, sum), lse)) << n;
    ASSERT_TRUE(SameBits(1.0f / sum, inv)) << n;
    for (int64_t j = 0; j < n; ++j) ASSERT_TRUE(SameBits(e[j], num[j])) << n << j;
    const float top = *std::max_element(num.begin(), num.end());
    EXPECT_TRUE(top > 0.5f && top <= 1.0f) << n << ": " << top;
  }
  EXPECT_EQ(kmath::bf16_softmax_shift2(2.25f), 3.0f);
  EXPECT_EQ(kmath::bf16_softmax_shift2(-2.25f), -2.0f);
  EXPECT_EQ(kmath::bf16_softmax_shift2(-INFINITY), -INFINITY);
  EXPECT_EQ(kmath::pow2_whole(0.0f), 1.0f);
  EXPECT_EQ(kmath::pow2_whole(-3.0f), 0.125f);
  EXPECT_EQ(kmath::pow2_whole(-126.0f), std::ldexp(1.0f, -126));
  EXPECT_EQ(kmath::pow2_whole(-127.0f), 0.0f);
  EXPECT_EQ(kmath::pow2_whole(-INFINITY), 0.0f);
  EXPECT_EQ(kmath::pow2_whole(NAN), 0.0f);
  const auto bf16 = [](float f) { return kmath::bf16_to_fp32(kmath::fp32_to_bf16(f)); };
  for (const float s : randn(1000, 33, 4.0f)) {
    for (const float m : {3.0f, 5.0f, 9.0f}) {
      const float moved = bf16(std::exp2(s - m)) * kmath::pow2_whole(m - 9.0f);
      ASSERT_TRUE(SameBits(moved, bf16(std::exp2(s - 9.0f)))) << s << " from " << m;
    }
  }
  EXPECT_FLOAT_EQ(kmath::softmax_grad(0.25f, 2.0f, 0.5f), 0.375f);
}

TEST(KernelMath, CrossEntropyRowMatchesItsDefinition) {
  const int64_t V = 29;
  const int t = 11;
  const float coef = 0.125f;
  auto x = randn(V, 12, 2.0f);
  std::vector<float> p = x;
  const float lse = cpu::softmax_inplace(p.data(), V);
  double ref_lse = 0;
  for (float v : x) ref_lse += std::exp(double(v));
  ref_lse = std::log(ref_lse);
  EXPECT_NEAR(kmath::xent_loss(lse, x[t]), ref_lse - x[t], 1e-5);
  for (int64_t j = 0; j < V; ++j) {
    float g = kmath::xent_scale(p[j], coef);
    if (j == t) g = kmath::xent_target(g, coef);
    const double ref = coef * (std::exp(double(x[j]) - ref_lse) - (j == t ? 1.0 : 0.0));
    EXPECT_NEAR(g, ref, 1e-7) << j;
  }
  // Two roundings, never one fused multiply-subtract.
  volatile float scaled = 0.3f * 0.7f;
  EXPECT_TRUE(SameBits(kmath::xent_target(kmath::xent_scale(0.3f, 0.7f), 0.7f), scaled - 0.7f));
}

TEST(KernelMath, CastsEqualTheHostConversionsForEveryHalfAndSampledFloats) {
  for (uint32_t h = 0; h <= 0xffff; ++h) {
    const auto b = static_cast<uint16_t>(h);
    ASSERT_TRUE(SameBits(kmath::fp16_to_fp32(b), fp16_to_fp32(b))) << std::hex << h;
    ASSERT_EQ(kmath::float_bits(kmath::bf16_to_fp32(b)), kmath::float_bits(bf16_to_fp32(b)));
    // NaN payloads too: the quiet bit set as F16C does.
    ASSERT_EQ(kmath::float_bits(kmath::fp16_to_fp32(b)), kmath::float_bits(fp16_to_fp32(b)))
        << std::hex << h;
  }
  std::mt19937 rng(13);
  std::vector<uint32_t> bits;
  for (int i = 0; i < 1 << 20; ++i) bits.push_back(rng());
  for (uint32_t e = 0; e < 256; ++e)  // every exponent, with mantissas at the rounding edges
    for (uint32_t m : {0u, 1u, 0xfffu, 0x1000u, 0x1fffu, 0x2000u, 0x3000u, 0x7fffffu, 0x400000u})
      for (uint32_t s : {0u, 1u}) bits.push_back(s << 31 | e << 23 | m);
  for (uint32_t u : bits) {
    const float f = kmath::bits_float(u);
    ASSERT_EQ(kmath::fp32_to_fp16(f), fp32_to_fp16(f)) << std::hex << u;
    ASSERT_EQ(kmath::fp32_to_bf16(f), fp32_to_bf16(f)) << std::hex << u;
  }
  // The host kernels' bulk conversions (vector bodies and tails) agree too, on the same edges
  // (NaNs, infinities, ties, every exponent) and on normal values.
  std::vector<float> x = randn(1003, 14, 100.0f);
  for (uint32_t u : bits) x.push_back(kmath::bits_float(u));
  std::vector<uint16_t> half(x.size());
  for (DType t : {DType::BF16, DType::F16}) {
    cpu::from_fp32(x.data(), half.data(), t, static_cast<int64_t>(x.size()));
    for (size_t i = 0; i < x.size(); ++i)
      ASSERT_EQ(half[i], t == DType::BF16 ? kmath::fp32_to_bf16(x[i]) : kmath::fp32_to_fp16(x[i]))
          << dtype_name(t) << " " << std::hex << kmath::float_bits(x[i]);
  }
}

TEST(KernelMath, NonfiniteFlagsInfAndNaNOnly) {
  EXPECT_TRUE(kmath::nonfinite(std::numeric_limits<float>::infinity()));
  EXPECT_TRUE(kmath::nonfinite(-std::numeric_limits<float>::infinity()));
  EXPECT_TRUE(kmath::nonfinite(std::numeric_limits<float>::quiet_NaN()));
  EXPECT_FALSE(kmath::nonfinite(std::numeric_limits<float>::max()));
  EXPECT_FALSE(kmath::nonfinite(std::numeric_limits<float>::denorm_min()));
  EXPECT_FALSE(kmath::nonfinite(-0.0f));
}

// The GPU's Adam element (kmath::adam_at, what cuda::adam_step runs per element) against
// cpu_adam::adam_step on this CPU's vector kernels: the same bits for every formula, moment and
// copy-out kind, with and without decay (AdamW's and L2's), gradient scaling and bias
// correction, over values spanning many binades (so a reordered or contracted operation
// shows).
template <int M, int Formula, int O>
void expect_adam_at_matches(const cpu_adam::AdamParams& hp, const std::string& what) {
  using namespace cpu_adam::detail;
  constexpr size_t n = 4099;  // not a multiple of any vector width: the tails too
  std::vector<float> p = randn(n, 1), g = randn(n, 2, 0.01f), m0 = randn(n, 3, 0.001f),
                     v0 = randn(n, 4, 1e-6f);
  for (size_t i = 0; i < n; ++i) {
    v0[i] = std::fabs(v0[i]) * std::ldexp(1.0f, static_cast<int>(i % 13) - 6);
    g[i] *= std::ldexp(1.0f, static_cast<int>(i % 11) - 5);
  }
  const DType mt = M == kBF16 ? DType::BF16 : DType::F32;
  const size_t mb = dtype_size(mt);
  std::vector<std::byte> m(n * mb), v(n * mb);
  for (size_t i = 0; i < n; ++i) {
    if (M == kBF16) {
      reinterpret_cast<uint16_t*>(m.data())[i] = fp32_to_bf16(m0[i]);
      reinterpret_cast<uint16_t*>(v.data())[i] = fp32_to_bf16(v0[i]);
    } else {
      reinterpret_cast<float*>(m.data())[i] = m0[i];
      reinterpret_cast<float*>(v.data())[i] = v0[i];
    }
  }
  std::vector<float> p_gpu = p;
  std::vector<std::byte> m_gpu = m, v_gpu = v;
  std::vector<uint16_t> out(n), out_gpu(n);
  const DType ot = O == kOutF16 ? DType::F16 : DType::BF16;
  cpu_adam::adam_step(hp, n, p.data(), {g.data(), DType::F32}, {m.data(), v.data(), mt},
                      {O == kOutNone ? nullptr : out.data(), ot});
  const AdamCoeffs c = cpu_adam::adam_coefficients(hp);
  for (size_t i = 0; i < n; ++i)
    kmath::adam_at<M, Formula, O>(c, static_cast<int64_t>(i), p_gpu.data(), g.data(), m_gpu.data(),
                                  v_gpu.data(), out_gpu.data());
  size_t bad = 0;
  for (size_t i = 0; i < n && bad < 5; ++i) {
    if (kmath::float_bits(p[i]) != kmath::float_bits(p_gpu[i])) {
      ADD_FAILURE() << what << ": params[" << i << "] " << p[i] << " vs " << p_gpu[i];
      ++bad;
    }
  }
  EXPECT_EQ(m, m_gpu) << what << ": exp_avg";
  EXPECT_EQ(v, v_gpu) << what << ": exp_avg_sq";
  if (O != kOutNone) {
    EXPECT_EQ(out, out_gpu) << what << ": copy-out";
  }
}

TEST(KernelMath, AdamAtHasCpuAdamsBits) {
  using namespace cpu_adam::detail;
  for (const bool adamw : {true, false})
    for (const double wd : {0.0, 0.1})
      for (const double scale : {1.0, 0.37})
        for (const bool bc : {true, false}) {
          cpu_adam::AdamParams hp;
          hp.lr = 3e-3;
          hp.beta1 = 0.9;
          hp.beta2 = 0.95;
          hp.eps = 1e-8;
          hp.weight_decay = wd;
          hp.adamw_mode = adamw;
          hp.grad_scale = scale;
          hp.bias_correction = bc;
          hp.step = 7;
          const std::string what = std::string(adamw ? "adamw" : "adam") + " wd " +
                                   std::to_string(wd) + " scale " + std::to_string(scale) +
                                   (bc ? " bc" : "");
          hp.formula = cpu_adam::Formula::kDeepSpeed;
          expect_adam_at_matches<kF32, kDeepSpeed, kOutBF16>(hp, "deepspeed fp32 " + what);
          expect_adam_at_matches<kBF16, kDeepSpeed, kOutNone>(hp, "deepspeed bf16 " + what);
          expect_adam_at_matches<kF32, kDeepSpeed, kOutF16>(hp, "deepspeed fp16 out " + what);
          hp.formula = cpu_adam::Formula::kPyTorch;
          expect_adam_at_matches<kF32, kPyTorch, kOutNone>(hp, "pytorch fp32 " + what);
          expect_adam_at_matches<kBF16, kPyTorch, kOutBF16>(hp, "pytorch bf16 " + what);
        }
}

}  // namespace
}  // namespace outcore::device
