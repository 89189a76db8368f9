// Host kernels: see kernels.hpp.
#include "engine/model/kernels.hpp"

#include <cblas.h>
#include <immintrin.h>

#include <cmath>

namespace outcore::model::kernels {
namespace {

float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}

float silu(float g) { return g / (1.0f + std::exp(-g)); }

}  // namespace

void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, static_cast<blasint>(m), static_cast<blasint>(n),
              static_cast<blasint>(k), alpha, a, static_cast<blasint>(lda), b,
              static_cast<blasint>(ldb), beta, c, static_cast<blasint>(ldc));
}

float dot(const float* a, const float* b, int64_t n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  float s = hsum(_mm256_add_ps(acc0, acc1));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

float sum_squares(const float* a, int64_t n) { return dot(a, a, n); }

void add_inplace(float* y, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

void rmsnorm_forward(const float* x, const float* w, float eps, int64_t rows, int64_t dim, float* y,
                     float* rstd) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    float* yr = y + r * dim;
    const float s = 1.0f / std::sqrt(sum_squares(xr, dim) / static_cast<float>(dim) + eps);
    rstd[r] = s;
    for (int64_t i = 0; i < dim; ++i) yr[i] = w[i] * (xr[i] * s);
  }
}

void rmsnorm_backward(const float* dy, const float* x, const float* w, const float* rstd,
                      int64_t rows, int64_t dim, float* dx, float* dw) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* dyr = dy + r * dim;
    const float* xr = x + r * dim;
    float* dxr = dx + r * dim;
    const float s = rstd[r];
    // dxhat = dy * w; dx = s * (dxhat - x * s^2 * mean(dxhat * x))
    float acc = 0.0f;
    {
      __m256 a0 = _mm256_setzero_ps();
      int64_t i = 0;
      for (; i + 8 <= dim; i += 8)
        a0 = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(dyr + i), _mm256_loadu_ps(w + i)),
                             _mm256_loadu_ps(xr + i), a0);
      acc = hsum(a0);
      for (; i < dim; ++i) acc += dyr[i] * w[i] * xr[i];
    }
    const float c = s * s * acc / static_cast<float>(dim);
    for (int64_t i = 0; i < dim; ++i) {
      dxr[i] += s * (dyr[i] * w[i] - xr[i] * c);
      dw[i] += dyr[i] * (xr[i] * s);
    }
  }
}

void rope(float* x, int64_t rows, int64_t seq, int64_t heads, int64_t head_dim, const float* cos,
          const float* sin, bool inverse) {
  const int64_t half = head_dim / 2;
  const float sign = inverse ? -1.0f : 1.0f;
  for (int64_t r = 0; r < rows; ++r) {
    const float* c = cos + (r % seq) * half;
    const float* s = sin + (r % seq) * half;
    for (int64_t h = 0; h < heads; ++h) {
      float* x1 = x + (r * heads + h) * head_dim;
      float* x2 = x1 + half;
      for (int64_t j = 0; j < half; ++j) {
        const float a = x1[j], b = x2[j], sn = sign * s[j];
        x1[j] = a * c[j] - b * sn;
        x2[j] = b * c[j] + a * sn;
      }
    }
  }
}

void swiglu_forward(const float* g, const float* u, float* a, int64_t n) {
  for (int64_t i = 0; i < n; ++i) a[i] = silu(g[i]) * u[i];
}

void swiglu_backward(const float* da, const float* g, const float* u, float* dg, float* du,
                     int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float sig = 1.0f / (1.0f + std::exp(-g[i]));
    const float d = da[i];
    du[i] = d * (g[i] * sig);
    dg[i] = d * u[i] * (sig * (1.0f + g[i] * (1.0f - sig)));
  }
}

float softmax_inplace(float* row, int64_t n) {
  float m = row[0];
  for (int64_t j = 1; j < n; ++j) m = std::max(m, row[j]);
  float sum = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    row[j] = std::exp(row[j] - m);
    sum += row[j];
  }
  const float inv = 1.0f / sum;
  for (int64_t j = 0; j < n; ++j) row[j] *= inv;
  return m + std::log(sum);
}

void exp_shift(float* row, float lse, int64_t n) {
  for (int64_t j = 0; j < n; ++j) row[j] = std::exp(row[j] - lse);
}

}  // namespace outcore::model::kernels
