// sum_of_squares, has_inf_or_nan, scale_in_place: every ISA and dtype, odd sizes, threads.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "common/error.hpp"
#include "cpu_adam/adam_math.hpp"
#include "cpu_adam/cpu_adam.hpp"
#include "test_util.hpp"

namespace outcore::cpu_adam {
namespace {

using testing::bits_to_float;
using testing::first_bit_difference;
using testing::IsaGuard;
using testing::random_floats;
using testing::supported_isas;
using testing::to_half;

// n elements of `t` made from fp32 values, with the same values readable back as fp32.
struct Data {
  Data(const std::vector<float>& x, DType t) : type(t) {
    if (t == DType::F32) {
      f32 = x;
    } else {
      half = to_half(x, t);
      for (uint16_t h : half) f32.push_back(t == DType::BF16 ? bf16_to_fp32(h) : fp16_to_fp32(h));
    }
  }
  void* ptr() { return type == DType::F32 ? static_cast<void*>(f32.data()) : half.data(); }
  DType type;
  std::vector<float> f32;  // the exact values the kernel sees
  std::vector<uint16_t> half;
};

constexpr DType kTypes[] = {DType::F32, DType::BF16, DType::F16};
const size_t kSizes[] = {0, 1, 5, 15, 16, 17, 63, 64, 65, 127, 1000, 4097, 70001};

long double exact_sum_of_squares(const std::vector<float>& x) {
  long double s = 0;
  for (float v : x) s += static_cast<long double>(v) * v;
  return s;
}

TEST(SumOfSquares, MatchesLongDoubleSumForEveryIsaDtypeAndSize) {
  const Executor two(2);
  for (Isa isa : supported_isas()) {
    IsaGuard guard(isa);
    for (DType t : kTypes) {
      for (size_t n : kSizes) {
        SCOPED_TRACE(std::string(isa_name(isa)) + " " + std::string(dtype_name(t)) +
                     " n=" + std::to_string(n));
        Data d(random_floats(n, static_cast<uint32_t>(n), 0.01f), t);
        const long double want = exact_sum_of_squares(d.f32);
        for (const Executor* ex : {static_cast<const Executor*>(nullptr), &two}) {
          const double got = sum_of_squares(d.ptr(), t, n, ex);
          EXPECT_NEAR(got, static_cast<double>(want), 1e-13 * static_cast<double>(want) + 1e-300);
        }
      }
    }
  }
}

// The bits of a sum of squares are adam_math.hpp's lanes on every ISA (what lets the GPU's
// block sums, which follow the same lanes, stand in for the host's in the gradient norm).
// Values over many magnitudes make a different order of additions show in the last bits.
TEST(SumOfSquares, HasTheSameBitsOnEveryIsaAsTheLanesOfAdamMath) {
  const Executor two(2);
  for (DType t : kTypes) {
    for (size_t n : kSizes) {
      SCOPED_TRACE(std::string(dtype_name(t)) + " n=" + std::to_string(n));
      std::vector<float> x = random_floats(n, static_cast<uint32_t>(n) + 7, 0.01f);
      for (size_t i = 0; i < n; i += 3) x[i] *= static_cast<float>(1 << (i % 11));
      Data d(x, t);
      // The lanes over the exact values the kernels see.
      double lanes[math::kSquareLanes];
      for (int j = 0; j < math::kSquareLanes; ++j) lanes[j] = math::square_lane(d.f32.data(), n, j);
      const double want = math::reduce_square_lanes(lanes);
      const size_t block = 37;
      const size_t blocks = (n + block - 1) / block;
      std::vector<double> want_blocks(blocks);
      for (size_t b = 0; b < blocks; ++b) {
        const size_t len = std::min(block, n - b * block);
        for (int j = 0; j < math::kSquareLanes; ++j)
          lanes[j] = math::square_lane(d.f32.data() + b * block, len, j);
        want_blocks[b] = math::reduce_square_lanes(lanes);
      }
      for (Isa isa : supported_isas()) {
        SCOPED_TRACE(isa_name(isa));
        IsaGuard guard(isa);
        const double got = sum_of_squares(d.ptr(), t, n);
        EXPECT_EQ(std::memcmp(&got, &want, sizeof got), 0) << got << " vs " << want;
        std::vector<double> got_blocks(blocks);
        block_sums_of_squares(d.ptr(), t, n, block, got_blocks.data(), &two);
        EXPECT_EQ(first_bit_difference(got_blocks.data(), want_blocks.data(), blocks), -1);
      }
    }
  }
}

TEST(SumOfSquares, ThreadedSumCoversEveryChunk) {
  // Large enough to be split; each chunk holds one distinctive value.
  constexpr size_t n = 1 << 20;
  std::vector<float> x(n, 0.0f);
  x[0] = 1.0f;
  x[n / 2 + 3] = 2.0f;
  x[n - 1] = 4.0f;
  for (unsigned threads : {2u, 3u, 7u}) {
    const Executor ex(threads);
    EXPECT_EQ(sum_of_squares(x.data(), DType::F32, n, &ex), 21.0) << threads;
  }
}

TEST(SumOfSquares, IsFiniteExactlyWhenEveryElementIs) {
  for (Isa isa : supported_isas()) {
    IsaGuard guard(isa);
    std::vector<float> x(333, std::numeric_limits<float>::max());
    EXPECT_TRUE(std::isfinite(sum_of_squares(x.data(), DType::F32, x.size())));
    x[200] = INFINITY;
    EXPECT_FALSE(std::isfinite(sum_of_squares(x.data(), DType::F32, x.size())));
  }
}

// 0: +inf, 1: -inf, 2: quiet NaN, 3: signalling-pattern NaN, as raw 16-bit values.
uint16_t special(DType t, int which) {
  static constexpr uint16_t kBf16[] = {0x7f80, 0xff80, 0x7fc0, 0x7f81};
  static constexpr uint16_t kF16[] = {0x7c00, 0xfc00, 0x7e00, 0x7c01};
  return t == DType::BF16 ? kBf16[which] : kF16[which];
}

TEST(HasInfOrNan, FindsEveryKindOfNonFiniteAnywhere) {
  constexpr size_t n = 10007;  // crosses several 4096-element blocks and ends in a tail
  const Executor two(2);
  const size_t positions[] = {0, 1, 15, 16, 4095, 4096, 8191, n - 8, n - 1};
  for (Isa isa : supported_isas()) {
    IsaGuard guard(isa);
    for (DType t : kTypes) {
      Data clean(random_floats(n, 3, 100.0f), t);
      SCOPED_TRACE(std::string(isa_name(isa)) + " " + std::string(dtype_name(t)));
      EXPECT_FALSE(has_inf_or_nan(clean.ptr(), t, n));
      EXPECT_FALSE(has_inf_or_nan(clean.ptr(), t, n, &two));
      for (int which = 0; which < 4; ++which) {
        for (size_t pos : positions) {
          Data d = clean;
          if (t == DType::F32) {
            const uint32_t bits[] = {0x7f800000u, 0xff800000u, 0x7fc00000u, 0x7f800001u};
            d.f32[pos] = bits_to_float(bits[which]);
          } else {
            d.half[pos] = special(t, which);
          }
          EXPECT_TRUE(has_inf_or_nan(d.ptr(), t, n)) << "kind " << which << " at " << pos;
          EXPECT_FALSE(has_inf_or_nan(d.ptr(), t, pos)) << "kind " << which << " before " << pos;
        }
      }
    }
  }
}

TEST(HasInfOrNan, LargestFiniteValuesAreFinite) {
  for (Isa isa : supported_isas()) {
    IsaGuard guard(isa);
    std::vector<float> f(37, -std::numeric_limits<float>::max());
    std::vector<uint16_t> bf(37, 0x7f7f), h(37, 0x7bff);  // bf16 max, fp16 max (65504)
    EXPECT_FALSE(has_inf_or_nan(f.data(), DType::F32, 37));
    EXPECT_FALSE(has_inf_or_nan(bf.data(), DType::BF16, 37));
    EXPECT_FALSE(has_inf_or_nan(h.data(), DType::F16, 37));
  }
}

TEST(HasInfOrNan, ThreadedScanSeesTheLastChunk) {
  constexpr size_t n = 1 << 20;
  std::vector<float> x(n, 1.0f);
  x[n - 1] = NAN;
  const Executor two(2);
  EXPECT_TRUE(has_inf_or_nan(x.data(), DType::F32, n, &two));
  x[n - 1] = 1.0f;
  EXPECT_FALSE(has_inf_or_nan(x.data(), DType::F32, n, &two));
}

TEST(ScaleInPlace, EveryIsaMatchesScalarRoundingBitwise) {
  const Executor two(2);
  for (Isa isa : supported_isas()) {
    IsaGuard guard(isa);
    for (DType t : kTypes) {
      for (size_t n : kSizes) {
        SCOPED_TRACE(std::string(isa_name(isa)) + " " + std::string(dtype_name(t)) +
                     " n=" + std::to_string(n));
        std::vector<float> x = random_floats(n, 17, 10.0f);
        if (n > 3) x[1] = INFINITY, x[2] = NAN, x[3] = 3.0e38f;  // overflow and NaN handling
        Data d(x, t), want(x, t);
        const float scale = 0.7f;
        for (size_t i = 0; i < n; ++i) {
          const float r = want.f32[i] * scale;
          if (t == DType::F32) want.f32[i] = r;
          if (t == DType::BF16) want.half[i] = fp32_to_bf16(r);
          if (t == DType::F16) want.half[i] = fp32_to_fp16(r);
        }
        scale_in_place(d.ptr(), t, n, scale, n > 5000 ? &two : nullptr);
        if (t == DType::F32) {
          EXPECT_EQ(first_bit_difference(d.f32.data(), want.f32.data(), n), -1);
        } else {
          EXPECT_EQ(first_bit_difference(d.half.data(), want.half.data(), n), -1);
        }
      }
    }
  }
}

TEST(ScaleInPlace, Bf16RoundsTiesToEven) {
  // b = 1 + m/128 with m odd is a bf16 value; b * 1.5 = 1 + (64 + 1.5m)/128 lies exactly
  // halfway between two bf16 values for m < 42, so the result must have an even mantissa.
  for (Isa isa : supported_isas()) {
    IsaGuard guard(isa);
    std::vector<uint16_t> h;
    for (uint16_t m = 1; m < 42; m += 2) h.push_back(static_cast<uint16_t>(0x3f80 + m));
    const std::vector<uint16_t> in = h;
    scale_in_place(h.data(), DType::BF16, h.size(), 1.5f);
    for (size_t i = 0; i < h.size(); ++i) {
      const float exact = bf16_to_fp32(in[i]) * 1.5f;
      EXPECT_EQ(h[i] & 1, 0) << i;
      EXPECT_LT(std::abs(bf16_to_fp32(h[i]) - exact), 1.0f / 128.0f) << i;
      EXPECT_EQ(h[i], fp32_to_bf16(exact)) << i;
    }
  }
}

TEST(CompanionKernels, RejectNullInputAndUnknownDtype) {
  EXPECT_THROW(sum_of_squares(nullptr, DType::F32, 4), InvalidArgument);
  EXPECT_THROW(has_inf_or_nan(nullptr, DType::BF16, 4), InvalidArgument);
  EXPECT_THROW(scale_in_place(nullptr, DType::F16, 4, 2.0f), InvalidArgument);
  float x[4] = {1, 2, 3, 4};
  EXPECT_THROW(sum_of_squares(x, static_cast<DType>(5), 4), InvalidArgument);
  EXPECT_EQ(sum_of_squares(nullptr, DType::F32, 0), 0.0);
  EXPECT_FALSE(has_inf_or_nan(nullptr, DType::F32, 0));
  scale_in_place(nullptr, DType::F32, 0, 2.0f);
}

}  // namespace
}  // namespace outcore::cpu_adam
