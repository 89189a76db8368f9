// Host kernels: see kernels.hpp.
#include "engine/device/cpu/kernels.hpp"

#include <cblas.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "engine/device/kernel_math.hpp"

namespace outcore::device::cpu {
namespace {

float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}

// exp(x) for 8 lanes: x = n ln2 + r with |r| <= ln2/2, exp(r) by a degree-6 polynomial
// (Cephes expf coefficients), scaled by 2^n through the exponent bits. Relative error ~2 ulp;
// inputs below about -87.7 flush to 0, above 88.7 give inf, NaN stays NaN.
__m256 exp256(__m256 x) {
  // Operand order keeps NaN a NaN (max/min return the second operand when one is NaN).
  x = _mm256_min_ps(_mm256_set1_ps(88.7f), _mm256_max_ps(_mm256_set1_ps(-88.5f), x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 scaled = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  // n <= -127 (x below about -87.7) has no normal 2^n: flush those lanes to 0.
  return _mm256_and_ps(scaled, _mm256_cmp_ps(n, _mm256_set1_ps(-126.5f), _CMP_NLT_UQ));
}

}  // namespace

void from_fp32(const float* src, void* dst, DType dtype, int64_t n) {
  switch (dtype) {
    case DType::F32:
      std::copy(src, src + n, static_cast<float*>(dst));
      return;
    case DType::BF16: {
      // fp32_to_bf16, 8 at a time: u + 0x7fff + bit 16 of u, upper halves; NaNs keep their
      // upper half with the quiet bit set.
      auto* d = static_cast<uint16_t*>(dst);
      const __m256i bias = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1);
      const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
      const __m256i quiet = _mm256_set1_epi32(0x40);
      int64_t i = 0;
      for (; i + 8 <= n; i += 8) {
        const __m256i u = _mm256_castps_si256(_mm256_loadu_ps(src + i));
        const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
        const __m256i rounded =
            _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(bias, lsb)), 16);
        const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, abs_mask), inf);
        const __m256i kept = _mm256_or_si256(_mm256_srli_epi32(u, 16), quiet);
        const __m256i h = _mm256_blendv_epi8(rounded, kept, nan);
        const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0x08);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), _mm256_castsi256_si128(packed));
      }
      for (; i < n; ++i) d[i] = fp32_to_bf16(src[i]);
      return;
    }
    case DType::F16: {
      auto* d = static_cast<uint16_t*>(dst);
      int64_t i = 0;
      for (; i + 8 <= n; i += 8)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
      for (; i < n; ++i) d[i] = fp32_to_fp16(src[i]);
      return;
    }
  }
}

void to_fp32(const void* src, DType dtype, float* dst, int64_t n) {
  switch (dtype) {
    case DType::F32: {
      const auto* s = static_cast<const float*>(src);
      std::copy(s, s + n, dst);
      return;
    }
    case DType::BF16: {
      const auto* s = static_cast<const uint16_t*>(src);
      auto* d = reinterpret_cast<uint32_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = static_cast<uint32_t>(s[i]) << 16;
      return;
    }
    case DType::F16: {
      const auto* s = static_cast<const uint16_t*>(src);
      int64_t i = 0;
      for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i,
                         _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
      for (; i < n; ++i) dst[i] = fp16_to_fp32(s[i]);
      return;
    }
  }
}

void exp_inplace(float* x, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, exp256(_mm256_loadu_ps(x + i)));
  for (; i < n; ++i) x[i] = kmath::exp_fast(x[i]);
}

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

void scale_rows(float* x, int64_t rows, int64_t cols, int64_t ld, const float* scale) {
  for (int64_t r = 0; r < rows; ++r) {
    float* xr = x + r * ld;
    const float s = scale[r];
    for (int64_t c = 0; c < cols; ++c) xr[c] *= s;
  }
}

void rmsnorm_forward(const float* x, const float* w, float eps, int64_t rows, int64_t dim, float* y,
                     float* rstd, void* y_bf16) {
  std::vector<float> row(y_bf16 != nullptr ? static_cast<size_t>(dim) : 0);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    float* yr = y_bf16 != nullptr ? row.data() : y + r * dim;
    const float s = kmath::rmsnorm_rstd(sum_squares(xr, dim), dim, eps);
    rstd[r] = s;
    for (int64_t i = 0; i < dim; ++i) yr[i] = kmath::rmsnorm_y(xr[i], w[i], s);
    if (y_bf16 != nullptr)
      from_fp32(yr, static_cast<uint16_t*>(y_bf16) + r * dim, DType::BF16, dim);
  }
}

namespace {
// sum(dy * w * x) over a row: RMSNorm backward's dot, 8 lanes, then the tail in order.
float rmsnorm_row_dot(const float* dyr, const float* w, const float* xr, int64_t dim) {
  __m256 a0 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= dim; i += 8)
    a0 = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(dyr + i), _mm256_loadu_ps(w + i)),
                         _mm256_loadu_ps(xr + i), a0);
  float acc = hsum(a0);
  for (; i < dim; ++i) acc += dyr[i] * w[i] * xr[i];
  return acc;
}
}  // namespace

void rmsnorm_backward(const float* dy, const float* x, const float* w, const float* rstd,
                      int64_t rows, int64_t dim, float* dx, float* dw) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* dyr = dy + r * dim;
    const float* xr = x + r * dim;
    float* dxr = dx + r * dim;
    const float s = rstd[r];
    // dxhat = dy * w; dx = s * (dxhat - x * s^2 * mean(dxhat * x))
    const float c = kmath::rmsnorm_grad_coef(s, rmsnorm_row_dot(dyr, w, xr, dim), dim);
    for (int64_t i = 0; i < dim; ++i) {
      dxr[i] += kmath::rmsnorm_dx(dyr[i], w[i], xr[i], s, c);
      dw[i] += kmath::rmsnorm_dw(dyr[i], xr[i], s);
    }
  }
}

void rmsnorm_backward_coef(const float* dy, const float* x, const float* w, const float* rstd,
                           int64_t rows, int64_t dim, float* coef) {
  for (int64_t r = 0; r < rows; ++r)
    coef[r] =
        kmath::rmsnorm_grad_coef(rstd[r], rmsnorm_row_dot(dy + r * dim, w, x + r * dim, dim), dim);
}

void rmsnorm_backward_columns(const float* dy, const float* x, const float* w, const float* rstd,
                              const float* coef, int64_t rows, int64_t ld, int64_t cols, float* dx,
                              float* dw) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* dyr = dy + r * ld;
    const float* xr = x + r * ld;
    float* dxr = dx + r * ld;
    const float s = rstd[r], c = coef[r];
    for (int64_t i = 0; i < cols; ++i) {
      dxr[i] += kmath::rmsnorm_dx(dyr[i], w[i], xr[i], s, c);
      dw[i] += kmath::rmsnorm_dw(dyr[i], xr[i], s);
    }
  }
}

void rope(float* x, int64_t rows, int64_t seq, int64_t heads, int64_t head_dim, const float* cos,
          const float* sin, bool inverse, void* x_bf16, int64_t first_row) {
  const int64_t half = head_dim / 2;
  const float sign = inverse ? -1.0f : 1.0f;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t position = (first_row + r) % seq;
    const float* c = cos + position * half;
    const float* s = sin + position * half;
    for (int64_t h = 0; h < heads; ++h) {
      float* x1 = x + (r * heads + h) * head_dim;
      float* x2 = x1 + half;
      for (int64_t j = 0; j < half; ++j) {
        kmath::rope_rotate(x1[j], x2[j], c[j], sign * s[j], x1[j], x2[j]);
      }
    }
    if (x_bf16 != nullptr)  // the row while it is in cache
      from_fp32(x + r * heads * head_dim, static_cast<uint16_t*>(x_bf16) + r * heads * head_dim,
                DType::BF16, heads * head_dim);
  }
}

namespace {

// sigmoid(g) for 8 lanes.
__m256 sigmoid256(__m256 g) {
  const __m256 one = _mm256_set1_ps(1.0f);
  return _mm256_div_ps(one, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), g))));
}

}  // namespace

namespace {
// Elements of an fp32 pass taken at a time where its result goes to bf16.
constexpr int64_t kRoundedSpan = 1024;
}  // namespace

void swiglu_forward(const float* g, const float* u, float* a, int64_t n, void* a_bf16) {
  if (a_bf16 != nullptr) {  // span by span through a buffer that stays in L1
    float span[kRoundedSpan];
    for (int64_t i0 = 0; i0 < n; i0 += kRoundedSpan) {
      const int64_t m = std::min(kRoundedSpan, n - i0);
      swiglu_forward(g + i0, u + i0, span, m);
      from_fp32(span, static_cast<uint16_t*>(a_bf16) + i0, DType::BF16, m);
    }
    return;
  }
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    _mm256_storeu_ps(a + i,
                     _mm256_mul_ps(_mm256_mul_ps(gv, sigmoid256(gv)), _mm256_loadu_ps(u + i)));
  }
  for (; i < n; ++i) a[i] = kmath::swiglu(g[i], u[i]);
}

void swiglu_backward(const float* da, const float* g, const float* u, float* dg, float* du,
                     int64_t n, void* dg_bf16, void* du_bf16) {
  if (dg_bf16 != nullptr) {
    float dg_span[kRoundedSpan], du_span[kRoundedSpan];
    for (int64_t i0 = 0; i0 < n; i0 += kRoundedSpan) {
      const int64_t m = std::min(kRoundedSpan, n - i0);
      swiglu_backward(da + i0, g + i0, u + i0, dg_span, du_span, m);
      from_fp32(dg_span, static_cast<uint16_t*>(dg_bf16) + i0, DType::BF16, m);
      from_fp32(du_span, static_cast<uint16_t*>(du_bf16) + i0, DType::BF16, m);
    }
    return;
  }
  const __m256 one = _mm256_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i), d = _mm256_loadu_ps(da + i);
    const __m256 sig = sigmoid256(gv);
    // silu'(g) = sig * (1 + g * (1 - sig))
    const __m256 dsilu = _mm256_mul_ps(sig, _mm256_fmadd_ps(gv, _mm256_sub_ps(one, sig), one));
    _mm256_storeu_ps(du + i, _mm256_mul_ps(d, _mm256_mul_ps(gv, sig)));
    _mm256_storeu_ps(dg + i, _mm256_mul_ps(_mm256_mul_ps(d, _mm256_loadu_ps(u + i)), dsilu));
  }
  for (; i < n; ++i) kmath::swiglu_grad(da[i], g[i], u[i], dg[i], du[i]);
}

float max_value(const float* x, int64_t n) {
  __m256 m8 = _mm256_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(x + i));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  float m = _mm_cvtss_f32(m4);
  for (; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

namespace {
// row[j] = exp(row[j] - shift) for j < n; returns their sum (8 lanes, then the tail in order).
float exp_sum(float* row, float shift, int64_t n) {
  const __m256 mv = _mm256_set1_ps(shift);
  __m256 acc = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(row + j), mv));
    _mm256_storeu_ps(row + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  float sum = hsum(acc);
  for (; j < n; ++j) {
    row[j] = kmath::softmax_exp(row[j], shift);
    sum += row[j];
  }
  return sum;
}
}  // namespace

float softmax_inplace(float* row, int64_t n) {
  const float m = max_value(row, n);
  const float sum = exp_sum(row, m, n);
  const float inv = 1.0f / sum;
  for (int64_t j = 0; j < n; ++j) row[j] *= inv;
  return kmath::softmax_lse(m, sum);
}

float softmax_numerators(float* row, int64_t n, float* inv_sum) {
  const float m = kmath::bf16_softmax_shift(max_value(row, n));
  const float sum = exp_sum(row, m, n);
  *inv_sum = 1.0f / sum;
  return kmath::softmax_lse(m, sum);
}

float log_sum_exp(const float* x, int64_t n) {
  const float m = max_value(x, n);
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    acc = _mm256_add_ps(acc, exp256(_mm256_sub_ps(_mm256_loadu_ps(x + j), mv)));
  float sum = hsum(acc);
  for (; j < n; ++j) sum += kmath::softmax_exp(x[j], m);
  return kmath::softmax_lse(m, sum);
}

void exp_shift(float* row, float lse, int64_t n) {
  const __m256 lv = _mm256_set1_ps(lse);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    _mm256_storeu_ps(row + j, exp256(_mm256_sub_ps(_mm256_loadu_ps(row + j), lv)));
  for (; j < n; ++j) row[j] = kmath::softmax_exp(row[j], lse);
}

}  // namespace outcore::device::cpu
