// The per-element and per-row arithmetic of the model's kernels, written once as
// `__host__ __device__` functions: the host kernels (engine/device/cpu/kernels.cpp) and the CUDA
// kernels (engine/device/cuda/cuda_kernels.cu) both call these, so the arithmetic is unit-tested on
// machines without a GPU. Only reductions (sums, maxima over a row) and launch geometry differ
// between the two: the host reduces in fixed 8/16-lane order, the GPU in a block tree.
//
// Each function mirrors, operation for operation, what the host's AVX2 lanes compute, so the
// host kernels' scalar tails and vector bodies agree bit for bit (tests/device/kernel_math_test).
// On the GPU the compiler may contract a*b+c into one fma where the host does not; the CUDA
// kernels' tests state their tolerances accordingly.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_adam/adam_math.hpp"

#if defined(__CUDACC__)
#define OUTCORE_HD __host__ __device__ __forceinline__
#else
#define OUTCORE_HD inline
#endif

namespace outcore::kmath {

OUTCORE_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

OUTCORE_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// ---------------------------------------------------------------------------------------------
// exp and the activations built on it

// exp(x) as the host's exp256 lane computes it: x = n ln2 + r with |r| <= ln2/2, exp(r) by a
// degree-6 polynomial (Cephes expf coefficients), scaled by 2^n through the exponent bits.
// Relative error ~2 ulp; x below about -87.7 gives 0, above 88.7 gives inf, NaN stays NaN.
OUTCORE_HD float exp_fast(float x) {
  // As _mm256_max_ps / _mm256_min_ps with x second: a NaN x passes through.
  x = (-88.5f > x) ? -88.5f : x;
  x = (88.7f < x) ? 88.7f : x;
  const float n = rintf(x * 1.44269504088896341f);  // round half to even
  float r = fmaf(-n, 0.693359375f, x);
  r = fmaf(-n, -2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = fmaf(p, r, 1.3981999507e-3f);
  p = fmaf(p, r, 8.3334519073e-3f);
  p = fmaf(p, r, 4.1665795894e-2f);
  p = fmaf(p, r, 1.6666665459e-1f);
  p = fmaf(p, r, 5.0000001201e-1f);
  p = fmaf(p, r * r, r + 1.0f);
  // n is in [-128, 128] here; a NaN n scales by 2^0, as the vector conversion's bits do.
  const int32_t ni = (n == n) ? static_cast<int32_t>(n) : 0;
  const float scaled = p * bits_float(static_cast<uint32_t>(ni + 127) << 23);
  // n <= -127 has no normal 2^n: flush to 0 (the comparison is false for NaN, kept).
  return (n < -126.5f) ? 0.0f : scaled;
}

// 1 / (1 + exp(-g)).
OUTCORE_HD float sigmoid(float g) { return 1.0f / (1.0f + exp_fast(0.0f - g)); }

// SwiGLU forward: silu(g) * u.
OUTCORE_HD float swiglu(float g, float u) { return (g * sigmoid(g)) * u; }

// SwiGLU backward for a = silu(g) * u given da: du = da * silu(g), dg = da * u * silu'(g) with
// silu'(g) = sig * (1 + g * (1 - sig)).
OUTCORE_HD void swiglu_grad(float da, float g, float u, float& dg, float& du) {
  const float sig = sigmoid(g);
  const float dsilu = sig * fmaf(g, 1.0f - sig, 1.0f);
  du = da * (g * sig);
  dg = (da * u) * dsilu;
}

// ---------------------------------------------------------------------------------------------
// RMSNorm (per row: y = w * x * rstd, rstd = 1 / sqrt(mean(x^2) + eps))

// rstd of a row of `dim` elements whose squares sum to `sum_sq`.
OUTCORE_HD float rmsnorm_rstd(float sum_sq, int64_t dim, float eps) {
  return 1.0f / sqrtf(sum_sq / static_cast<float>(dim) + eps);
}

OUTCORE_HD float rmsnorm_y(float x, float w, float rstd) { return w * (x * rstd); }

// The row coefficient of the backward, from acc = sum(dy * w * x) over the row.
OUTCORE_HD float rmsnorm_grad_coef(float rstd, float acc, int64_t dim) {
  return rstd * rstd * acc / static_cast<float>(dim);
}

// The contribution of one element to dL/dx (added to dx by the caller).
OUTCORE_HD float rmsnorm_dx(float dy, float w, float x, float rstd, float coef) {
  return rstd * (dy * w - x * coef);
}

// The contribution of one element to dL/dw (summed over rows by the caller, in row order).
OUTCORE_HD float rmsnorm_dw(float dy, float x, float rstd) { return dy * (x * rstd); }

// ---------------------------------------------------------------------------------------------
// Rotary embedding ("rotate half"): the pair (a, b) = (x[j], x[j + head_dim/2]) rotated by the
// angle whose cosine is c and sine is s (s negated by the caller for the inverse rotation).

OUTCORE_HD void rope_rotate(float a, float b, float c, float s, float& x1, float& x2) {
  x1 = a * c - b * s;
  x2 = b * c + a * s;
}

// ---------------------------------------------------------------------------------------------
// Softmax over a row (causal attention rows use the first `query + 1` keys)

// Keys a causal query at position `query` (0-based, within its sequence) attends to.
OUTCORE_HD int64_t causal_keys(int64_t query) { return query + 1; }

// exp(x - max) of one element.
OUTCORE_HD float softmax_exp(float x, float row_max) { return exp_fast(x - row_max); }

// A row's maximum and sum of exponentials in one pass (the "online softmax"): (m, s), starting
// at (-inf, 0), takes each element x; s stays the sum of exp(x - m) over the elements taken, m
// their maximum. A NaN element makes s NaN; -inf elements add 0 (before a finite one too). Two
// partial (m, s) go to a common maximum M through softmax_online_rescale (exp(0) is exactly 1: a
// part whose m is M keeps its s).
OUTCORE_HD void softmax_online_add(float x, float& m, float& s) {
  if (x > m) {
    s = fmaf(s, exp_fast(m - x), 1.0f);
    m = x;
  } else if (m > -INFINITY || x != x) {  // -inf after only -inf: exp(-inf - -inf) would be NaN
    s += exp_fast(x - m);
  }
}
OUTCORE_HD float softmax_online_rescale(float s, float m, float row_max) {
  return s * exp_fast(m - row_max);
}

// The row's log-sum-exp from its maximum and sum(exp(x - max)).
OUTCORE_HD float softmax_lse(float row_max, float sum_exp) { return row_max + logf(sum_exp); }

// bf16 attention's forward (decision 034) rounds the softmax's numerators exp(x - m) to bf16, m
// being the row's max rounded up to a multiple of ln 2, and divides the product with v by the
// row's sum afterwards. Two such shifts differ by a whole power of two, which scales a bf16 value
// exactly: a kernel that raises its shift key tile by key tile (FlashAttention's running max, in
// the base-2 domain) rounds every numerator as the host does, knowing the row's max beforehand.
// The shift of a row whose max is `row_max`:
OUTCORE_HD float bf16_softmax_shift(float row_max) {
  return ceilf(row_max * 1.44269504088896341f) * 0.693147180559945309f;
}
// The same in the base-2 domain: the shift of a (running) max `max2` = max * log2(e).
OUTCORE_HD float bf16_softmax_shift2(float max2) { return ceilf(max2); }
// 2^d for a whole d <= 0, exactly (0 below 2^-126, for -inf and for NaN): the factor that moves
// numerators, and their sum, from one base-2 shift to a larger one.
OUTCORE_HD float pow2_whole(float d) {
  return d >= -126.0f ? bits_float(static_cast<uint32_t>(static_cast<int32_t>(d) + 127) << 23)
                      : 0.0f;
}

// Softmax backward for one element: dscore = p * (dp - D), D = sum(p * dp) over the row (or, in
// bf16 attention, its equal dattn . attn: bf16_row_dot).
OUTCORE_HD float softmax_grad(float p, float dp, float dot_p_dp) { return p * (dp - dot_p_dp); }

// ---------------------------------------------------------------------------------------------
// Cross-entropy of a row of logits against target t, with the gradient of coef * loss:
// loss = lse - logit[t]; dlogit[j] = coef * p[j] - (j == t ? coef : 0), as two roundings
// (xent_scale, then xent_target on the target's element). A target below 0 is ignored (Hugging
// Face's -100 labels, a loss mask): its row's loss is 0 and its gradient row all zeros.

OUTCORE_HD bool xent_ignored(int32_t target) { return target < 0; }

OUTCORE_HD float xent_loss(float lse, float target_logit) { return lse - target_logit; }

OUTCORE_HD float xent_scale(float p, float coef) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(p, coef);  // never fused with xent_target's subtraction
#else
  return p * coef;
#endif
}

OUTCORE_HD float xent_target(float scaled_p, float coef) { return scaled_p - coef; }

// ---------------------------------------------------------------------------------------------
// Casts (storage dtypes). bf16: the upper half of an fp32 rounded to nearest even, NaN kept
// NaN. fp16: IEEE binary16, round to nearest even, as the host's F16C instructions do.

OUTCORE_HD uint16_t fp32_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

OUTCORE_HD float bf16_to_fp32(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

// The attention backward's D for one query row of one head in bf16 compute: the dot of the
// forward's output row and its gradient row (n bf16 values each), summed in fp32 in order. Each
// product of two bf16 values is exact in fp32, so a contracted fma finds the same bits: the host
// and the GPU agree exactly.
OUTCORE_HD float bf16_row_dot(const uint16_t* a, const uint16_t* b, int64_t n) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += bf16_to_fp32(a[i]) * bf16_to_fp32(b[i]);
  return sum;
}
// The same sum two elements at a time, for a kernel that loads a row's bf16 pairs as words (the
// lower element in the lower half): `sum` plus the lower product, then the upper one.
OUTCORE_HD float bf16_row_dot_pair(float sum, uint32_t a, uint32_t b) {
  sum += bf16_to_fp32(static_cast<uint16_t>(a & 0xffffu)) *
         bf16_to_fp32(static_cast<uint16_t>(b & 0xffffu));
  return sum + bf16_to_fp32(static_cast<uint16_t>(a >> 16)) *
                   bf16_to_fp32(static_cast<uint16_t>(b >> 16));
}

OUTCORE_HD uint16_t fp32_to_fp16(float f) {
  uint32_t x = float_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((x >> 13) & 0x3ffu));
  if (x >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520: inf
  if (x >= 0x38800000u) {  // a normal half: rebias the exponent, round the mantissa to even
    return static_cast<uint16_t>(sign | ((x - 0x38000000u + 0xfffu + ((x >> 13) & 1u)) >> 13));
  }
  const uint32_t e = x >> 23;
  if (e < 102) return static_cast<uint16_t>(sign);  // below 2^-25 (a tie at 2^-25 goes to 0)
  const uint32_t m = (x & 0x7fffffu) | 0x800000u;   // value = m * 2^(e - 150)
  const uint32_t shift = 126 - e;                   // in units of 2^-24: m >> shift
  uint32_t h = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
  if (rem > half || (rem == half && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}

OUTCORE_HD float fp16_to_fp32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu;
  uint32_t m = h & 0x3ffu;
  if (e == 0x1f) return bits_float(sign | 0x7f800000u | (m != 0 ? (m | 0x200u) << 13 : 0u));
  if (e != 0) return bits_float(sign | ((e + 112u) << 23) | (m << 13));
  if (m == 0) return bits_float(sign);
  uint32_t k = 0;  // a subnormal half: normalize
  while ((m & 0x400u) == 0) {
    m <<= 1;
    ++k;
  }
  return bits_float(sign | ((113u - k) << 23) | ((m & 0x3ffu) << 13));
}

// ---------------------------------------------------------------------------------------------
// Gradient checks

// True for inf and NaN (the overflow check of fp16 loss scaling).
OUTCORE_HD bool nonfinite(float x) { return (float_bits(x) & 0x7f800000u) == 0x7f800000u; }

// ---------------------------------------------------------------------------------------------
// Adam

// Element i of one Adam step as the GPU's kernel computes it: moments of kind M (kF32 or
// kBF16: widened exactly, rounded to nearest even on store), copy-out of kind O (kOutNone,
// kOutBF16, kOutF16), the arithmetic cpu_adam::math::adam_element's, so the bits are
// cpu_adam::adam_step's (tests/device/kernel_math_test.cpp).
template <int M, int Formula, int O>
OUTCORE_HD void adam_at(const cpu_adam::detail::AdamCoeffs& c, int64_t i, float* p, const float* g,
                        void* m, void* v, void* out) {
  using namespace cpu_adam::detail;
  float param = p[i], mi, vi;
  if constexpr (M == kBF16) {
    mi = bf16_to_fp32(static_cast<const uint16_t*>(m)[i]);
    vi = bf16_to_fp32(static_cast<const uint16_t*>(v)[i]);
  } else {
    mi = static_cast<const float*>(m)[i];
    vi = static_cast<const float*>(v)[i];
  }
  cpu_adam::math::adam_element<Formula>(c, g[i], param, mi, vi);
  if constexpr (M == kBF16) {
    static_cast<uint16_t*>(m)[i] = fp32_to_bf16(mi);
    static_cast<uint16_t*>(v)[i] = fp32_to_bf16(vi);
  } else {
    static_cast<float*>(m)[i] = mi;
    static_cast<float*>(v)[i] = vi;
  }
  p[i] = param;
  if constexpr (O == kOutBF16) static_cast<uint16_t*>(out)[i] = fp32_to_bf16(param);
  if constexpr (O == kOutF16) static_cast<uint16_t*>(out)[i] = fp32_to_fp16(param);
}

}  // namespace outcore::kmath
