// Numeric helpers of the kernel tests: seeded normal data and an element-wise comparison that
// asks either for the same bits or for a stated relative tolerance.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace outcore::test {

// n values from N(0, scale^2), the same for the same seed.
inline std::vector<float> randn(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// rel == 0 asks for the same bits; otherwise finite values within rel of max(1, |want|), the same
// infinity, and a NaN where a NaN is expected (its payload may differ).
inline void expect_close(const std::vector<float>& got, const std::vector<float>& want, double rel,
                         const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(want[i]) && rel != 0.0) {
      ASSERT_TRUE(std::isnan(got[i])) << what << " @" << i << ": got " << got[i];
    } else if (rel == 0.0 || std::isinf(want[i])) {
      ASSERT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(want[i]))
          << what << " @" << i << ": got " << got[i] << ", want " << want[i];
    } else {
      ASSERT_NEAR(got[i], want[i], rel * std::max(1.0, std::abs(double(want[i]))))
          << what << " @" << i;
    }
  }
}

// max |a[i] - b[i]| over max |b[i]|: an error relative to the tensor's scale (absolute when b is
// all zeros).
template <typename A, typename B>
double scaled_error(const A* a, const B* b, size_t n) {
  double err = 0, scale = 0;
  for (size_t i = 0; i < n; ++i) {
    err = std::max(err, std::abs(static_cast<double>(a[i]) - static_cast<double>(b[i])));
    scale = std::max(scale, std::abs(static_cast<double>(b[i])));
  }
  return scale > 0 ? err / scale : err;
}

}  // namespace outcore::test
