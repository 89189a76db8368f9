// The CUDA backend's kernels whose threads work together (block reductions, warp shuffles,
// shared memory): RMSNorm forward and backward, the causal softmax, the fused cross-entropy, the
// sum of squares and the gradient norm's block sums. One source for two machines, like
// flash_attention_tiles.hpp: engine/device/cuda/cuda_kernels.cu runs these bodies as CUDA
// kernels, and the tests run the same bodies on the host under the SIMT emulation of a thread
// block (tests/common/simt.hpp), so every index, barrier, shuffle and vectorized load is checked
// on machines without a GPU. The arithmetic per element is kernel_math.hpp's.
//
// A body is a template over X, the thread's view of its machine:
//   int thread() const, threads() const        threadIdx.x, blockDim.x (a multiple of 32)
//   int block(axis) const, blocks() const      blockIdx.{x,y,z}, gridDim.x
//   unsigned char* shared()                    the block's shared memory (on 16 bytes; as many
//                                              bytes as the body's k...Shared constant)
//   void sync()                                __syncthreads
//   float shfl_xor(float v, int mask)          __shfl_xor_sync over the whole warp
//   double shfl(double v, int lane, int width) __shfl_sync over the whole warp: lane `lane` of
//                                              this thread's `width`-lane segment
//   void load4(const float* p, float (&v)[4])  one 16-byte load (p on 16 bytes)
// Every thread of a block calls each reduction and collective (no early exit before one, but a
// return the whole block takes).
#pragma once

#include <cmath>
#include <cstdint>

#include "cpu_adam/adam_math.hpp"
#include "engine/device/kernel_math.hpp"
#include "engine/device/rmsnorm_dw_split.hpp"

#if defined(__CUDACC__)
#define OUTCORE_BLOCK __device__ __forceinline__
#define OUTCORE_BLOCK_UNROLL _Pragma("unroll")
#else
#define OUTCORE_BLOCK inline
#define OUTCORE_BLOCK_UNROLL
#endif

namespace outcore::device::blocks {

struct Sum {
  OUTCORE_BLOCK float operator()(float a, float b) const { return a + b; }
};
struct Max {
  OUTCORE_BLOCK float operator()(float a, float b) const { return fmaxf(a, b); }
};

// Shared memory of the reductions below: a value per warp, and the result.
inline constexpr int kReduceShared = 33 * sizeof(float);

// Reduces v over the block (a fixed tree: deterministic); the lanes of warp 0 hold the result.
template <typename X, typename Op>
OUTCORE_BLOCK float block_reduce(X& x, float v, Op op, float identity) {
  float* warp_result = reinterpret_cast<float*>(x.shared());
  for (int o = 16; o > 0; o >>= 1) v = op(v, x.shfl_xor(v, o));
  const int lane = x.thread() % 32, warp = x.thread() / 32;
  x.sync();  // warp_result may still be read by a previous call
  if (lane == 0) warp_result[warp] = v;
  x.sync();
  v = x.thread() < x.threads() / 32 ? warp_result[x.thread()] : identity;
  for (int o = 16; o > 0; o >>= 1) v = op(v, x.shfl_xor(v, o));
  return v;
}

// block_reduce's result in every thread (broadcast through shared memory).
template <typename X, typename Op>
OUTCORE_BLOCK float block_all_reduce(X& x, float v, Op op, float identity) {
  float* result = reinterpret_cast<float*>(x.shared()) + 32;
  v = block_reduce(x, v, op, identity);
  if (x.thread() == 0) *result = v;
  x.sync();
  v = *result;
  x.sync();
  return v;
}

// out[i] = v in fp32, or rounded to bf16 into out16[i] when out16 is given.
OUTCORE_BLOCK void store(float* out, uint16_t* out16, int64_t i, float v) {
  if (out16 != nullptr)
    out16[i] = kmath::fp32_to_bf16(v);
  else
    out[i] = v;
}

// --- RMSNorm: a block per row ----------------------------------------------------------------

template <typename X>
OUTCORE_BLOCK void rmsnorm_forward_row(X& x, const float* in, const float* w, float eps,
                                       int64_t dim, float* y, uint16_t* y16, float* rstd) {
  const int64_t row = x.block(0);
  const float* xr = in + row * dim;
  float ss = 0.0f;
  for (int64_t i = x.thread(); i < dim; i += x.threads()) ss += xr[i] * xr[i];
  const float s = kmath::rmsnorm_rstd(block_all_reduce(x, ss, Sum{}, 0.0f), dim, eps);
  if (x.thread() == 0) rstd[row] = s;
  for (int64_t i = x.thread(); i < dim; i += x.threads())
    store(y, y16, row * dim + i, kmath::rmsnorm_y(xr[i], w[i], s));
}

template <typename X>
OUTCORE_BLOCK void rmsnorm_dx_row(X& x, const float* dy, const float* in, const float* w,
                                  const float* rstd, int64_t dim, float* dx) {
  const int64_t row = x.block(0), at = row * dim;
  float acc = 0.0f;
  for (int64_t i = x.thread(); i < dim; i += x.threads()) acc += dy[at + i] * w[i] * in[at + i];
  const float s = rstd[row];
  const float coef = kmath::rmsnorm_grad_coef(s, block_all_reduce(x, acc, Sum{}, 0.0f), dim);
  for (int64_t i = x.thread(); i < dim; i += x.threads())
    dx[at + i] += kmath::rmsnorm_dx(dy[at + i], w[i], in[at + i], s, coef);
}

// The weight gradient: a block of kDwColumns x kDwLanes threads sums one tile of columns (block
// x) over one range of rows (block y; rmsnorm_dw_split.hpp): it reads kDwLanes rows of the tile
// at a time (coalesced), lane l summing rows first + l, first + l + kDwLanes, ... in order; the
// lanes' sums are then added in lane order, into dw (one range) or into the range's row of
// `partials`, which rmsnorm_dw_ranges adds into dw in range order. Deterministic (no atomics);
// the order differs from the host's (rows in order) by the lane and range split only.
inline constexpr int kDwColumns = static_cast<int>(norm::kDwColumns), kDwLanes = 32,
                     kDwThreads = kDwColumns * kDwLanes, kDwAhead = 8;
inline constexpr int kDwShared = kDwLanes * kDwColumns * sizeof(float);

template <typename X>
OUTCORE_BLOCK void rmsnorm_dw_tile(X& x, const float* dy, const float* in, const float* rstd,
                                   int64_t rows, int64_t rows_per_range, int64_t dim, float* dw,
                                   float* partials) {
  float* lane_sum = reinterpret_cast<float*>(x.shared());  // [kDwLanes][kDwColumns]
  // Unsigned, as threadIdx and blockIdx are: with int's signed division and widening the kernel
  // took 46 registers instead of 32 (one block of 1024 threads per SM instead of two).
  const auto tid = static_cast<unsigned>(x.thread());
  const int col = static_cast<int>(tid % kDwColumns), lane = static_cast<int>(tid / kDwColumns);
  const int64_t i = int64_t{static_cast<unsigned>(x.block(0))} * kDwColumns + col;
  const norm::RowRange range =
      norm::dw_rows(static_cast<unsigned>(x.block(1)), rows_per_range, rows);
  float acc = 0.0f;
  if (i < dim) {
    // kDwAhead rows' loads issued together, then added in row order: the same sum as one row at
    // a time, with that many more loads in flight.
    int64_t r = range.first + lane;
    for (; r + (kDwAhead - 1) * kDwLanes < range.end; r += kDwAhead * kDwLanes) {
      float d[kDwAhead], v[kDwAhead], s[kDwAhead];
      OUTCORE_BLOCK_UNROLL
      for (int k = 0; k < kDwAhead; ++k) {
        const int64_t row = r + k * kDwLanes;
        d[k] = dy[row * dim + i], v[k] = in[row * dim + i], s[k] = rstd[row];
      }
      OUTCORE_BLOCK_UNROLL
      for (int k = 0; k < kDwAhead; ++k) acc += kmath::rmsnorm_dw(d[k], v[k], s[k]);
    }
    for (; r < range.end; r += kDwLanes)
      acc += kmath::rmsnorm_dw(dy[r * dim + i], in[r * dim + i], rstd[r]);
  }
  lane_sum[lane * kDwColumns + col] = acc;
  x.sync();
  if (lane == 0 && i < dim) {
    float total = partials == nullptr ? dw[i] : 0.0f;
    for (int l = 0; l < kDwLanes; ++l) total += lane_sum[l * kDwColumns + col];
    if (partials == nullptr)
      dw[i] = total;
    else
      partials[int64_t{x.block(1)} * dim + i] = total;
  }
}

// dw[i] += the ranges' partial sums of column i, in range order (a grid-stride loop).
template <typename X>
OUTCORE_BLOCK void rmsnorm_dw_ranges(X& x, const float* partials, int64_t ranges, int64_t dim,
                                     float* dw) {
  for (int64_t i = int64_t{x.block(0)} * x.threads() + x.thread(); i < dim;
       i += int64_t{x.blocks()} * x.threads()) {
    float total = dw[i];
    for (int64_t k = 0; k < ranges; ++k) total += partials[k * dim + i];
    dw[i] = total;
  }
}

// --- attention's softmax: a block per (matrix, row) ------------------------------------------

template <typename X>
OUTCORE_BLOCK void causal_softmax_forward_row(X& x, float* scores, float* lse, int64_t rows,
                                              int64_t keys, int64_t first_query, int64_t lse_stride,
                                              float* inv_sum) {
  const int64_t row = x.block(0);  // b * rows + i
  float* s = scores + row * keys;
  const int64_t n = kmath::causal_keys(first_query + row % rows);
  float m = -INFINITY;
  for (int64_t j = x.thread(); j < n; j += x.threads()) m = fmaxf(m, s[j]);
  m = block_all_reduce(x, m, Max{}, -INFINITY);
  if (inv_sum != nullptr) m = kmath::bf16_softmax_shift(m);
  float sum = 0.0f;
  for (int64_t j = x.thread(); j < n; j += x.threads()) {
    s[j] = kmath::softmax_exp(s[j], m);
    sum += s[j];
  }
  sum = block_all_reduce(x, sum, Sum{}, 0.0f);
  const float inv = 1.0f / sum;
  const float f = inv_sum != nullptr ? 1.0f : inv;  // numerators stay as they are
  for (int64_t j = x.thread(); j < keys; j += x.threads()) s[j] = j < n ? s[j] * f : 0.0f;
  const int64_t at = row / rows * lse_stride + row % rows;
  if (x.thread() == 0) {
    lse[at] = kmath::softmax_lse(m, sum);
    if (inv_sum != nullptr) inv_sum[at] = inv;
  }
}

template <typename X>
OUTCORE_BLOCK void causal_softmax_backward_row(X& x, float* scores, float* dp, const float* lse,
                                               int64_t rows, int64_t keys, int64_t first_query,
                                               int64_t lse_stride, const float* delta) {
  const int64_t row = x.block(0);
  float* p = scores + row * keys;
  float* d = dp + row * keys;
  const int64_t n = kmath::causal_keys(first_query + row % rows);
  const int64_t at = row / rows * lse_stride + row % rows;
  const float l = lse[at];
  float dot = 0.0f;
  for (int64_t j = x.thread(); j < keys; j += x.threads()) {
    p[j] = j < n ? kmath::softmax_exp(p[j], l) : 0.0f;
    // Keys past the causal edge add nothing (a non-finite dp there must not reach the sum,
    // as the host's dot over the row's first n keys).
    if (delta == nullptr && j < n) dot += p[j] * d[j];
  }
  dot = delta != nullptr ? delta[at] : block_all_reduce(x, dot, Sum{}, 0.0f);
  for (int64_t j = x.thread(); j < keys; j += x.threads())
    d[j] = j < n ? kmath::softmax_grad(p[j], d[j], dot) : 0.0f;
}

// --- cross-entropy: a block per row ----------------------------------------------------------

// f(j, row[j]) for this thread's elements of a row of n floats: 16-byte loads, four elements a
// thread, where the row starts on 16 bytes and n is a multiple of 4 (more bytes in flight per
// thread: a 128256-wide row is read at memory speed), else one element at a time. Every pass over
// a row gives a thread the same elements.
template <typename X, typename F>
OUTCORE_BLOCK void each_in_row(X& x, const float* row, int64_t n, F f) {
  if (n % 4 == 0 && reinterpret_cast<uintptr_t>(row) % 16 == 0) {
    for (int64_t i = x.thread(); i < n / 4; i += x.threads()) {
      float v[4];
      x.load4(row + 4 * i, v);
      OUTCORE_BLOCK_UNROLL
      for (int k = 0; k < 4; ++k) f(4 * i + k, v[k]);
    }
  } else {
    for (int64_t j = x.thread(); j < n; j += x.threads()) f(j, row[j]);
  }
}

// The row's loss (row_loss) and, with `grad`, the gradient of coef x loss: into the logits, or
// rounded to bf16 into grad_bf16's row (the logits then stay). A target below 0 is not trained
// on: loss 0, gradient 0.
template <typename X>
OUTCORE_BLOCK void cross_entropy_row(X& x, float* logits, const int32_t* targets, int64_t vocab,
                                     float coef, bool grad, float* row_loss, uint16_t* grad_bf16) {
  const int64_t row = x.block(0);
  float* s = logits + row * vocab;
  uint16_t* g16 = grad_bf16 != nullptr ? grad_bf16 + row * vocab : nullptr;
  const int32_t t = targets[row];
  if (kmath::xent_ignored(t)) {  // the whole block takes this branch
    if (x.thread() == 0) row_loss[row] = 0.0f;
    if (grad)
      for (int64_t j = x.thread(); j < vocab; j += x.threads()) store(s, g16, j, 0.0f);
    return;
  }
  const float target_logit = s[t];
  // The row's max and sum of exponentials in one read of it (the gradient reads it once more):
  // each thread's own (max, sum), then the block's max, and the sums moved to it and added.
  float m = -INFINITY, sum = 0.0f;
  each_in_row(x, s, vocab, [&](int64_t, float v) { kmath::softmax_online_add(v, m, sum); });
  const float row_max = block_all_reduce(x, m, Max{}, -INFINITY);
  sum = block_all_reduce(x, kmath::softmax_online_rescale(sum, m, row_max), Sum{}, 0.0f);
  m = row_max;
  if (x.thread() == 0) row_loss[row] = kmath::xent_loss(kmath::softmax_lse(m, sum), target_logit);
  if (!grad) return;
  const float inv = 1.0f / sum;
  each_in_row(x, s, vocab, [&](int64_t j, float v) {  // a thread writes only what it has read
    const float g = kmath::xent_scale(kmath::softmax_exp(v, m) * inv, coef);
    store(s, g16, j, j == t ? kmath::xent_target(g, coef) : g);
  });
}

// --- gradient checks -------------------------------------------------------------------------

// Block b's sum of squares of its grid-stride elements into partials[b].
template <typename X>
OUTCORE_BLOCK void sum_squares_partials(X& x, const float* in, int64_t n, float* partials) {
  float s = 0.0f;
  for (int64_t i = int64_t{x.block(0)} * x.threads() + x.thread(); i < n;
       i += int64_t{x.blocks()} * x.threads())
    s += in[i] * in[i];
  s = block_reduce(x, s, Sum{}, 0.0f);
  if (x.thread() == 0) partials[x.block(0)] = s;
}

// The sum of `count` partials (one block).
template <typename X>
OUTCORE_BLOCK void sum_partials(X& x, const float* partials, int count, float* out) {
  float s = 0.0f;
  for (int i = x.thread(); i < count; i += x.threads()) s += partials[i];
  s = block_reduce(x, s, Sum{}, 0.0f);
  if (x.thread() == 0) *out = s;
}

// The gradient norm's block sums with CPU Adam's bits: one thread per lane of a block of `block`
// elements (kSquareLanes consecutive threads, a half-warp), square_lane each; the lanes meet in
// the block's first thread, which adds them in reduce_square_lanes' order. Every thread of a
// warp takes part in the shuffles.
template <typename X>
OUTCORE_BLOCK void block_sums_of_squares(X& x, const float* in, int64_t n, int64_t block,
                                         int64_t blocks, double* out) {
  constexpr int kLanes = cpu_adam::math::kSquareLanes;
  const int64_t t = int64_t{x.block(0)} * x.threads() + x.thread();
  const int64_t b = t / kLanes;
  const int lane = static_cast<int>(t % kLanes);
  double acc = 0.0;
  if (b < blocks) {
    const int64_t first = b * block;
    const int64_t len = n - first < block ? n - first : block;
    acc = cpu_adam::math::square_lane(in + first, static_cast<size_t>(len), lane);
  }
  double lanes[kLanes];
  OUTCORE_BLOCK_UNROLL
  for (int j = 0; j < kLanes; ++j) lanes[j] = x.shfl(acc, j, kLanes);
  if (lane == 0 && b < blocks) out[b] = cpu_adam::math::reduce_square_lanes(lanes);
}

}  // namespace outcore::device::blocks
