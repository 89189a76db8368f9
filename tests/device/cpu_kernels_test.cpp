// Host kernels against plain double-precision references.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "engine/device/cpu/kernels.hpp"
#include "engine/device/token_groups.hpp"
#include "tests/common/numeric.hpp"

namespace outcore::device::cpu {
namespace {

using outcore::test::randn;

TEST(Kernels, GemmHonoursTransposesLeadingDimensionsAndBeta) {
  const int64_t m = 5, n = 7, k = 9, lda = 12, ldb = 11, ldc = 10;
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      auto a = randn(20 * lda, 1), b = randn(20 * ldb, 2), c = randn(m * ldc, 3);
      auto c0 = c;
      gemm(ta, tb, m, n, k, 0.5f, a.data(), lda, b.data(), ldb, 2.0f, c.data(), ldc);
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t j = 0; j < n; ++j) {
          double s = 0;
          for (int64_t p = 0; p < k; ++p)
            s += double(ta ? a[p * lda + i] : a[i * lda + p]) *
                 (tb ? b[j * ldb + p] : b[p * ldb + j]);
          EXPECT_NEAR(c[i * ldc + j], 0.5 * s + 2.0 * c0[i * ldc + j], 1e-5) << ta << tb;
        }
        for (int64_t j = n; j < ldc; ++j) EXPECT_EQ(c[i * ldc + j], c0[i * ldc + j]);  // untouched
      }
    }
  }
}

TEST(Kernels, DotAndSumSquaresHandleTails) {
  for (int64_t n : {0, 1, 15, 16, 17, 100}) {
    auto a = randn(n, 4), b = randn(n, 5);
    double d = 0, q = 0;
    for (int64_t i = 0; i < n; ++i) d += double(a[i]) * b[i], q += double(a[i]) * a[i];
    EXPECT_NEAR(dot(a.data(), b.data(), n), d, 1e-5);
    EXPECT_NEAR(sum_squares(a.data(), n), q, 1e-4);
  }
}

TEST(Kernels, RmsNormForwardAndBackwardMatchReference) {
  const int64_t rows = 3, dim = 37;
  const float eps = 1e-5f;
  auto x = randn(rows * dim, 6), w = randn(dim, 7), dy = randn(rows * dim, 8);
  std::vector<float> y(rows * dim), rstd(rows), dx(rows * dim, 0.5f), dw(dim, 0.25f);
  rmsnorm_forward(x.data(), w.data(), eps, rows, dim, y.data(), rstd.data());
  rmsnorm_backward(dy.data(), x.data(), w.data(), rstd.data(), rows, dim, dx.data(), dw.data());
  std::vector<double> dw_ref(dim, 0.25);
  for (int64_t r = 0; r < rows; ++r) {
    double ms = 0;
    for (int64_t i = 0; i < dim; ++i) ms += double(x[r * dim + i]) * x[r * dim + i];
    const double s = 1.0 / std::sqrt(ms / dim + eps);
    EXPECT_NEAR(rstd[r], s, 1e-5 * s);
    double dot_term = 0;
    for (int64_t i = 0; i < dim; ++i) dot_term += double(dy[r * dim + i]) * w[i] * x[r * dim + i];
    for (int64_t i = 0; i < dim; ++i) {
      const double xi = x[r * dim + i];
      EXPECT_NEAR(y[r * dim + i], w[i] * xi * s, 1e-5);
      const double dxi = s * dy[r * dim + i] * w[i] - xi * s * s * s * dot_term / dim;
      EXPECT_NEAR(dx[r * dim + i], 0.5 + dxi, 1e-5);
      dw_ref[i] += dy[r * dim + i] * xi * s;
    }
  }
  for (int64_t i = 0; i < dim; ++i) EXPECT_NEAR(dw[i], dw_ref[i], 1e-5);
}

TEST(Kernels, RopeRotatesHalvesByPositionAndInverseUndoesIt) {
  const int64_t seq = 5, rows = 10, heads = 3, hd = 8, half = hd / 2;
  std::vector<float> cos(seq * half), sin(seq * half);
  for (int64_t t = 0; t < seq; ++t)
    for (int64_t j = 0; j < half; ++j) {
      const double a = t * std::pow(10000.0, -2.0 * j / hd);
      cos[t * half + j] = float(std::cos(a));
      sin[t * half + j] = float(std::sin(a));
    }
  auto x = randn(rows * heads * hd, 9);
  auto y = x;
  rope(y.data(), rows, seq, heads, hd, cos.data(), sin.data(), false);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < hd; ++i) {
        const float* xr = x.data() + (r * heads + h) * hd;
        const int64_t j = i % half, t = r % seq;
        const double rot = i < half ? -xr[i + half] : xr[i - half];  // rotate_half
        EXPECT_NEAR(y[(r * heads + h) * hd + i],
                    xr[i] * cos[t * half + j] + rot * sin[t * half + j], 1e-6);
      }
  rope(y.data(), rows, seq, heads, hd, cos.data(), sin.data(), true);
  for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(y[i], x[i], 1e-6);
}

TEST(Kernels, SwigluBackwardMatchesDerivative) {
  const int64_t n = 50;
  auto g = randn(n, 10, 3.0f), u = randn(n, 11), da = randn(n, 12);
  std::vector<float> a(n), dg(n), du(n);
  swiglu_forward(g.data(), u.data(), a.data(), n);
  swiglu_backward(da.data(), g.data(), u.data(), dg.data(), du.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    const double gi = g[i], s = 1.0 / (1.0 + std::exp(-gi));
    EXPECT_NEAR(a[i], gi * s * u[i], 1e-5);
    EXPECT_NEAR(du[i], da[i] * gi * s, 1e-5);
    EXPECT_NEAR(dg[i], da[i] * u[i] * (s + gi * s * (1 - s)), 1e-5);
  }
}

TEST(Kernels, SoftmaxReturnsLogSumExpAndExpShiftReproducesIt) {
  auto x = randn(33, 13, 5.0f);
  auto p = x;
  const float lse = softmax_inplace(p.data(), 33);
  double m = *std::max_element(x.begin(), x.end()), s = 0;
  for (float v : x) s += std::exp(v - m);
  EXPECT_NEAR(lse, m + std::log(s), 1e-5);
  double total = 0;
  for (float v : p) total += v;
  EXPECT_NEAR(total, 1.0, 1e-6);
  auto q = x;
  exp_shift(q.data(), lse, 33);
  for (int i = 0; i < 33; ++i) EXPECT_NEAR(q[i], p[i], 1e-6);
}

TEST(Kernels, VectorExpIsAccurateOverTheUsefulRange) {
  std::vector<float> x;
  for (float v = -87.0f; v <= 88.0f; v += 0.37f) x.push_back(v);
  x.push_back(-1e30f);  // far below: 0
  x.push_back(-INFINITY);
  x.push_back(NAN);  // overflow detection needs NaN to survive
  x.push_back(INFINITY);
  auto e = x;
  exp_inplace(e.data(), static_cast<int64_t>(e.size()));
  for (size_t i = 0; i + 4 < x.size(); ++i) {
    const double want = std::exp(double(x[i]));
    EXPECT_NEAR(e[i], want, 4e-7 * want) << x[i];
  }
  EXPECT_EQ(e[e.size() - 4], 0.0f);
  EXPECT_EQ(e[e.size() - 3], 0.0f);
  EXPECT_TRUE(std::isnan(e[e.size() - 2]));
  EXPECT_TRUE(std::isinf(e.back()));
  std::vector<float> tail = {NAN, 1.0f, 2.0f};  // the scalar tail path too
  exp_inplace(tail.data(), 3);
  EXPECT_TRUE(std::isnan(tail[0]));
  EXPECT_NEAR(tail[2], std::exp(2.0), 1e-6);
  EXPECT_NEAR(log_sum_exp(x.data(), 10),
              softmax_inplace(std::vector<float>(x.begin(), x.begin() + 10).data(), 10), 0);
}

// TokenGroups (the CUDA embedding backward's grouping): every position once, grouped by id in
// increasing id order, token order kept within a group.
TEST(TokenGroups, EveryPositionOnceGroupedByIdInTokenOrder) {
  const std::vector<int32_t> ids{5, 2, 5, 9, 2, 2, 0, 5};
  const TokenGroups g(ids);
  ASSERT_EQ(g.tokens(), 8);
  ASSERT_EQ(g.groups(), 4);
  EXPECT_EQ(std::vector<int32_t>(g.id(), g.id() + 4), (std::vector<int32_t>{0, 2, 5, 9}));
  EXPECT_EQ(std::vector<int32_t>(g.start(), g.start() + 5), (std::vector<int32_t>{0, 1, 4, 7, 8}));
  EXPECT_EQ(std::vector<int32_t>(g.order(), g.order() + 8),
            (std::vector<int32_t>{6, 1, 4, 5, 0, 2, 7, 3}));
  EXPECT_EQ(g.packed().size(), 8u + 5u + 4u);
  const TokenGroups empty(std::vector<int32_t>{});
  EXPECT_EQ(empty.groups(), 0);
  EXPECT_EQ(empty.packed().size(), 1u);  // start[0]
}

}  // namespace
}  // namespace outcore::device::cpu
