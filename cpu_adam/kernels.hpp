// Internal: the kernel table every ISA fills in, and the per-step coefficients the Adam kernels
// read. Included by the AVX-512 translation unit, so it holds only plain types: nothing here
// may be an inline function that the linker could merge across ISAs.
#pragma once

#include <cstddef>
#include <cstdint>

namespace outcore::cpu_adam::detail {

// Element kinds, in the order of outcore::DType (F32, BF16, F16).
inline constexpr int kF32 = 0;
inline constexpr int kBF16 = 1;
inline constexpr int kF16 = 2;
// Output kinds of the Adam kernel: no copy-out, bf16 copy, fp16 copy.
inline constexpr int kOutNone = 0;
inline constexpr int kOutBF16 = 1;
inline constexpr int kOutF16 = 2;
// Formulas, in the order of cpu_adam::Formula.
inline constexpr int kDeepSpeed = 0;
inline constexpr int kPyTorch = 1;

// Per-step constants, each computed in double from AdamParams and rounded once to fp32.
struct AdamCoeffs {
  float beta1;
  float beta2;
  float one_minus_beta1;
  float one_minus_beta2;
  float eps;
  float step_size;  // -lr / bc1
  float bc2;  // kDeepSpeed: 1/sqrt(1 - beta2^t), multiplies sqrt(v); kPyTorch: sqrt(1 - beta2^t),
              // divides it
  float l2;   // weight_decay, added to the gradient when `use_l2`
  float decoupled;   // kDeepSpeed: -lr*wd (p += decoupled*p); kPyTorch: 1 - lr*wd (p *= decoupled)
  float grad_scale;  // multiplies the gradient when `use_scale`
  bool use_l2;
  bool use_decoupled;
  bool use_scale;
};

// n elements; g points to n elements of the grad kind, m and v to n elements of the moment kind
// (kF32 or kBF16), out to n elements of the out kind (or is null for kOutNone).
using AdamFn = void (*)(const AdamCoeffs& c, size_t n, float* p, const void* g, void* m, void* v,
                        void* out);
using SumSqFn = double (*)(const void* x, size_t n);
using NonFiniteFn = bool (*)(const void* x, size_t n);
using ScaleFn = void (*)(void* x, size_t n, float scale);

struct KernelTable {
  AdamFn adam[2][2][3][3];  // [moment kind: kF32, kBF16][formula][grad kind][out kind]
  SumSqFn sum_of_squares[3];
  NonFiniteFn has_inf_or_nan[3];
  ScaleFn scale_in_place[3];
};

const KernelTable& scalar_kernels();
const KernelTable& avx2_kernels();
const KernelTable& avx512_kernels();

}  // namespace outcore::cpu_adam::detail
