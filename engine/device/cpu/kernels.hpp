// Host kernels of the CPU backend (engine/device/cpu; also the host reference the CUDA kernels
// are tested against): a row-major sgemm wrapper over OpenBLAS, dtype conversions, and
// vectorized (AVX2/FMA/F16C, the x86-64-v3 baseline) elementwise and reduction kernels. Every
// reduction runs in a fixed order, so results are bit-identical run after run. Pointers are
// host-dereferenceable; no call allocates or throws.
#pragma once

#include <cstdint>

#include "common/dtype.hpp"

namespace outcore::device::cpu {

// dst[i] = src[i] as fp32 (src in `dtype` storage) / dst[i] = src[i] rounded to `dtype` (nearest
// even; NaN stays NaN).
void to_fp32(const void* src, DType dtype, float* dst, int64_t n);
void from_fp32(const float* src, void* dst, DType dtype, int64_t n);

// C[m,n] = alpha * op(A) op(B) + beta * C, row-major; op(A) is [m,k], op(B) is [k,n].
// beta == 0 ignores C's old contents (NaNs included).
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

// sum(a[i] * b[i]) and sum(a[i]^2), accumulated in 16 fixed fp32 lanes then summed in order.
float dot(const float* a, const float* b, int64_t n);
float sum_squares(const float* a, int64_t n);

// y += x.
void add_inplace(float* y, const float* x, int64_t n);

// RMSNorm over rows of `dim`: rstd[r] = 1/sqrt(mean(x[r]^2) + eps); y = w * x * rstd. With
// y_bf16, y goes there rounded to bf16 instead (y unused, may be null).
void rmsnorm_forward(const float* x, const float* w, float eps, int64_t rows, int64_t dim, float* y,
                     float* rstd, void* y_bf16 = nullptr);
// Given dL/dy: dx += dL/dx and dw += dL/dw (rows summed in order), in one pass row by row.
void rmsnorm_backward(const float* dy, const float* x, const float* w, const float* rstd,
                      int64_t rows, int64_t dim, float* dx, float* dw);
// The same in two passes that split among threads with the same bits: each row's coefficient
// (rows on their own), then dx and dw for the columns j < cols of rows of leading dimension ld
// (columns on their own, each summing its rows in order).
void rmsnorm_backward_coef(const float* dy, const float* x, const float* w, const float* rstd,
                           int64_t rows, int64_t dim, float* coef);
void rmsnorm_backward_columns(const float* dy, const float* x, const float* w, const float* rstd,
                              const float* coef, int64_t rows, int64_t ld, int64_t cols, float* dx,
                              float* dw);

// Rotary embedding ("rotate half") in place on x = [rows, heads * head_dim], row r at position
// (first_row + r) % seq. cos/sin are [seq, head_dim/2]. inverse applies the transposed rotation
// (backward). With x_bf16, the result is also written there rounded to bf16 (as from_fp32
// rounds it).
void rope(float* x, int64_t rows, int64_t seq, int64_t heads, int64_t head_dim, const float* cos,
          const float* sin, bool inverse, void* x_bf16 = nullptr, int64_t first_row = 0);

// a = silu(g) * u; with a_bf16, rounded to bf16 there instead (a unused, may be null).
void swiglu_forward(const float* g, const float* u, float* a, int64_t n, void* a_bf16 = nullptr);
// dg = da * u * silu'(g), du = da * silu(g). dg may alias da. With dg_bf16 and du_bf16 (both or
// neither), rounded to bf16 there instead (dg and du unused, may be null).
void swiglu_backward(const float* da, const float* g, const float* u, float* dg, float* du,
                     int64_t n, void* dg_bf16 = nullptr, void* du_bf16 = nullptr);

// x[i] = exp(x[i]), vectorized (about 2 ulp; below about -87.7 gives 0).
void exp_inplace(float* x, int64_t n);
// max(x[0..n)), n >= 1.
float max_value(const float* x, int64_t n);

// Softmax of row[0..n) in place; returns the log-sum-exp of the input.
float softmax_inplace(float* row, int64_t n);
// bf16 attention's numerators (decision 034): row[j] = exp(row[j] - m) for j < n, m =
// kmath::bf16_softmax_shift(max); *inv_sum = 1 / their sum; returns the log-sum-exp.
float softmax_numerators(float* row, int64_t n, float* inv_sum);
// x[r * ld + c] *= scale[r] for r < rows, c < cols.
void scale_rows(float* x, int64_t rows, int64_t cols, int64_t ld, const float* scale);
// log(sum(exp(x[j]))) over j < n, without changing x; the same value softmax_inplace returns.
float log_sum_exp(const float* x, int64_t n);
// row[j] = exp(row[j] - lse) for j < n.
void exp_shift(float* row, float lse, int64_t n);

}  // namespace outcore::device::cpu
