// The per-element arithmetic of one Adam step, and the lanes of a sum of squares, written once
// for the host's scalar kernels (kernels_scalar.cpp) and the GPU's
// (engine/device/cuda/cuda_kernels.cu). Adam: explicit fma,
// correctly rounded square root and division, in the order the vector kernels follow, so every
// ISA and the GPU give the same bits. On the GPU every operation is an intrinsic that rounds to
// nearest on its own (__fmaf_rn, __fmul_rn, ...), which the compiler never contracts; on the
// host a product is kept from contraction whatever the translation unit's flags (mul_rn).
//
// Not for the AVX translation units (kernels.hpp says why): only kernels_scalar.cpp, the CUDA
// kernels and tests include it.
#pragma once

#include <cmath>

#include "cpu_adam/kernels.hpp"

#if defined(__CUDACC__)
#define OUTCORE_ADAM_HD __host__ __device__ __forceinline__
#else
#define OUTCORE_ADAM_HD inline
#endif

namespace outcore::cpu_adam::math {

// a * b + c and a + b, rounded once, in float (Adam) or double (sums of squares).
template <class T>
OUTCORE_ADAM_HD T fma_rn(T a, T b, T c) {
#if defined(__CUDA_ARCH__)
  if constexpr (sizeof(T) == sizeof(float))
    return __fmaf_rn(a, b, c);
  else
    return __fma_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
template <class T>
OUTCORE_ADAM_HD T add_rn(T a, T b) {
#if defined(__CUDA_ARCH__)
  if constexpr (sizeof(T) == sizeof(float))
    return __fadd_rn(a, b);
  else
    return __dadd_rn(a, b);
#else
  return a + b;
#endif
}
OUTCORE_ADAM_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  float r = a * b;
  // Rounded here, never fused into an addition that uses it: a translation unit built with
  // GCC's default -ffp-contract=fast would fuse it once inlined; the empty asm (an SSE
  // register operand: x86-64, the only target) hides it.
#if defined(__x86_64__)
  asm("" : "+x"(r));
#else
  volatile float kept = r;
  r = kept;
#endif
  return r;
#endif
}
OUTCORE_ADAM_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
OUTCORE_ADAM_HD float sqrt_rn(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

// One element: `grad` as stored (widened to fp32), `param` the fp32 master weight, `m` and `v`
// the moments widened to fp32. On return `param`, `m` and `v` hold the new values before any
// rounding to a narrower storage type (the caller rounds the moments it stores; the update
// already used the fp32 ones, as DeepSpeed's CPU Adam does).
template <int Formula>
OUTCORE_ADAM_HD void adam_element(const detail::AdamCoeffs& c, float grad, float& param, float& m,
                                  float& v) {
  if (c.use_scale) grad = mul_rn(grad, c.grad_scale);
  if (c.use_l2) grad = fma_rn(param, c.l2, grad);
  m = fma_rn(grad, c.one_minus_beta1, mul_rn(m, c.beta1));
  v = fma_rn(mul_rn(grad, grad), c.one_minus_beta2, mul_rn(v, c.beta2));
  const float root = sqrt_rn(v);
  if constexpr (Formula == detail::kDeepSpeed) {
    const float update = div_rn(m, fma_rn(root, c.bc2, c.eps));
    if (c.use_decoupled) param = fma_rn(param, c.decoupled, param);
    param = fma_rn(update, c.step_size, param);
  } else {
    const float denom = add_rn(div_rn(root, c.bc2), c.eps);
    if (c.use_decoupled) param = mul_rn(param, c.decoupled);
    param = add_rn(param, div_rn(mul_rn(c.step_size, m), denom));
  }
}

// A sum of squares (the gradient norm's block sums) in kSquareLanes double lanes: lane j adds
// x[i]^2 for every i = j mod kSquareLanes, in increasing i, each with one fma (an fp32 square is
// exact in double); the lanes are then added pairwise, j with j + 8, then + 4, + 2, + 1
// (reduce_square_lanes). Every ISA's kernel (AVX-512: two 8-double accumulators; AVX2: four
// 4-double ones; scalar: 16 doubles) and the GPU's (square_lane per thread) follow this order, so a
// block's sum has the same bits everywhere.
inline constexpr int kSquareLanes = 16;

// Lane `lane` of the fp32 elements x[0, n). Eight of the lane's elements are loaded before they
// are added (in order), so that a GPU thread has eight loads in flight.
OUTCORE_ADAM_HD double square_lane(const float* x, size_t n, int lane) {
  constexpr size_t kBatch = 8;
  double acc = 0.0;
  size_t i = static_cast<size_t>(lane);
  for (; i + (kBatch - 1) * kSquareLanes < n; i += kBatch * kSquareLanes) {
    double d[kBatch];
    for (size_t k = 0; k < kBatch; ++k) d[k] = x[i + k * kSquareLanes];
    for (size_t k = 0; k < kBatch; ++k) acc = fma_rn(d[k], d[k], acc);
  }
  for (; i < n; i += kSquareLanes) {
    const double d = x[i];
    acc = fma_rn(d, d, acc);
  }
  return acc;
}

// The lanes' total, added in the fixed pairwise order above (`lanes` is overwritten).
OUTCORE_ADAM_HD double reduce_square_lanes(double* lanes) {
  for (int half = kSquareLanes / 2; half >= 1; half /= 2)
    for (int j = 0; j < half; ++j) lanes[j] = add_rn(lanes[j], lanes[j + half]);
  return lanes[0];
}

}  // namespace outcore::cpu_adam::math
