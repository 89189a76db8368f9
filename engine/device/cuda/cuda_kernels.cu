// CUDA kernels of the model's math: see cuda_kernels.hpp. The arithmetic per element and per
// row is kernel_math.hpp's, the bodies of the kernels whose threads work together are
// block_kernels.hpp's (run on the host too, under tests/common/simt.hpp); this file holds the
// element-wise kernels and every launch.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>

#include "common/error.hpp"
#include "engine/device/block_kernels.hpp"
#include "engine/device/cuda/cuda_check.hpp"
#include "engine/device/cuda/cuda_kernels.hpp"
#include "engine/device/kernel_math.hpp"
#include "engine/device/rmsnorm_dw_split.hpp"

namespace outcore::device::cuda {
namespace {

constexpr int kThreads = 256;  // every kernel's block size (a multiple of 32)

cudaStream_t native(StreamHandle s) { return static_cast<cudaStream_t>(s); }

// Blocks of a grid-stride loop over n elements.
unsigned grid_for(int64_t n) {
  return static_cast<unsigned>(std::clamp<int64_t>((n + kThreads - 1) / kThreads, 1, 8192));
}

// block_kernels.hpp's X on a GPU: the thread itself, with kShared bytes of static shared memory
// (one array per kernel that uses it).
template <int kShared>
struct Thread {
  __device__ __forceinline__ int thread() const { return threadIdx.x; }
  __device__ __forceinline__ int threads() const { return blockDim.x; }
  __device__ __forceinline__ int block(int axis) const {
    return axis == 0 ? blockIdx.x : axis == 1 ? blockIdx.y : blockIdx.z;
  }
  __device__ __forceinline__ int blocks() const { return gridDim.x; }
  __device__ __forceinline__ unsigned char* shared() const {
    __shared__ __align__(16) unsigned char memory[kShared];
    return memory;
  }
  __device__ __forceinline__ void sync() const { __syncthreads(); }
  __device__ __forceinline__ float shfl_xor(float v, int mask) const {
    return __shfl_xor_sync(0xffffffffu, v, mask);
  }
  __device__ __forceinline__ double shfl(double v, int lane, int width) const {
    return __shfl_sync(0xffffffffu, v, lane, width);
  }
  __device__ __forceinline__ void load4(const float* p, float (&v)[4]) const {
    const float4 f = *reinterpret_cast<const float4*>(p);
    v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
  }
};

// One 16-bit value (bf16 or fp16, t) to and from fp32.
__device__ uint16_t half_bits(float f, DType t) {
  return t == DType::BF16 ? kmath::fp32_to_bf16(f) : kmath::fp32_to_fp16(f);
}
__device__ float half_value(uint16_t h, DType t) {
  return t == DType::BF16 ? kmath::bf16_to_fp32(h) : kmath::fp16_to_fp32(h);
}

__device__ float load_as_fp32(const void* p, DType t, int64_t i) {
  if (t == DType::F32) return static_cast<const float*>(p)[i];
  return half_value(static_cast<const uint16_t*>(p)[i], t);
}

// --- element-wise ----------------------------------------------------------------------------

__global__ void to_fp32_kernel(const void* src, DType t, float* dst, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    dst[i] = load_as_fp32(src, t, i);
}

__global__ void from_fp32_kernel(const float* src, void* dst, DType t, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    if (t == DType::F32)
      static_cast<float*>(dst)[i] = src[i];
    else
      static_cast<uint16_t*>(dst)[i] = half_bits(src[i], t);
  }
}

// The casts eight elements at a time (32 bytes of fp32, 16 of bf16 or fp16 per thread) where
// both buffers start on 16 bytes; the last n % 8 elements one at a time.
__device__ uint32_t half_pair(float lo, float hi, DType t) {
  return uint32_t(half_bits(lo, t)) | (uint32_t(half_bits(hi, t)) << 16);
}

__global__ void to_fp32_x8_kernel(const uint4* src, DType t, float4* dst, int64_t n) {
  const int64_t vectors = n / 8, first = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = first; i < vectors; i += stride) {
    const uint4 h = src[i];
    dst[2 * i] = make_float4(half_value(h.x & 0xffffu, t), half_value(h.x >> 16, t),
                             half_value(h.y & 0xffffu, t), half_value(h.y >> 16, t));
    dst[2 * i + 1] = make_float4(half_value(h.z & 0xffffu, t), half_value(h.z >> 16, t),
                                 half_value(h.w & 0xffffu, t), half_value(h.w >> 16, t));
  }
  const auto* tail = reinterpret_cast<const uint16_t*>(src);
  auto* out = reinterpret_cast<float*>(dst);
  for (int64_t i = 8 * vectors + first; i < n; i += stride) out[i] = half_value(tail[i], t);
}

__global__ void from_fp32_x8_kernel(const float4* src, uint4* dst, DType t, int64_t n) {
  const int64_t vectors = n / 8, first = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = first; i < vectors; i += stride) {
    const float4 a = src[2 * i], b = src[2 * i + 1];
    dst[i] = make_uint4(half_pair(a.x, a.y, t), half_pair(a.z, a.w, t), half_pair(b.x, b.y, t),
                        half_pair(b.z, b.w, t));
  }
  const auto* in = reinterpret_cast<const float*>(src);
  auto* tail = reinterpret_cast<uint16_t*>(dst);
  for (int64_t i = 8 * vectors + first; i < n; i += stride) tail[i] = half_bits(in[i], t);
}

bool on_16_bytes(const void* a, const void* b) {
  return (reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b)) % 16 == 0;
}

using blocks::store;  // out[i] = v in fp32, or rounded to bf16 into out16[i] when given

// V consecutive floats from i: one 16-byte load for V = 4 (p + i on 16 bytes).
template <int V>
__device__ __forceinline__ void load(const float* p, int64_t i, float (&v)[V]) {
  if constexpr (V == 4) {
    const float4 f = *reinterpret_cast<const float4*>(p + i);
    v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
  } else {
    for (int k = 0; k < V; ++k) v[k] = p[i + k];
  }
}
// store() of V consecutive values from i: one 16-byte store in fp32 or one 8-byte store in bf16
// for V = 4 (the destination on that many bytes), each value rounded as store() rounds it.
template <int V>
__device__ __forceinline__ void store(float* out, uint16_t* out16, int64_t i, const float (&v)[V]) {
  if constexpr (V == 4) {
    if (out16 != nullptr) {
      const auto pair = [](float lo, float hi) {
        return uint32_t{kmath::fp32_to_bf16(lo)} | uint32_t{kmath::fp32_to_bf16(hi)} << 16;
      };
      *reinterpret_cast<uint2*>(out16 + i) = make_uint2(pair(v[0], v[1]), pair(v[2], v[3]));
    } else {
      *reinterpret_cast<float4*>(out + i) = make_float4(v[0], v[1], v[2], v[3]);
    }
  } else {
    for (int k = 0; k < V; ++k) store(out, out16, i + k, v[k]);
  }
}

// Elementwise kernels take V = 4 elements a thread per step (16-byte loads: more bytes in flight
// per thread, the elementwise passes at memory speed) where n is a multiple of 4 and every
// operand starts on 16 bytes (8 for a bf16 output), else V = 1. The same formula per element
// either way: the same bits.
bool four_at_a_time(int64_t n, std::initializer_list<const void*> fp32,
                    std::initializer_list<const void*> bf16) {
  if (n % 4 != 0) return false;
  for (const void* p : fp32)
    if (p != nullptr && reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  for (const void* p : bf16)
    if (p != nullptr && reinterpret_cast<uintptr_t>(p) % 8 != 0) return false;
  return true;
}

// A block per row.
__global__ void scale_rows_kernel(float* x, int64_t cols, int64_t ld, const float* scale) {
  float* row = x + blockIdx.x * ld;
  const float s = scale[blockIdx.x];
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) row[c] *= s;
}

template <int V>
__global__ void add_kernel(float* y, const float* x, int64_t n) {
  for (int64_t i = V * (blockIdx.x * int64_t{blockDim.x} + threadIdx.x); i < n;
       i += V * int64_t{gridDim.x} * blockDim.x) {
    float yv[V], xv[V];
    load(y, i, yv);
    load(x, i, xv);
    for (int k = 0; k < V; ++k) yv[k] += xv[k];
    store(y, nullptr, i, yv);
  }
}

template <int V>
__global__ void swiglu_forward_kernel(const float* g, const float* u, float* a, uint16_t* a16,
                                      int64_t n) {
  for (int64_t i = V * (blockIdx.x * int64_t{blockDim.x} + threadIdx.x); i < n;
       i += V * int64_t{gridDim.x} * blockDim.x) {
    float gv[V], uv[V], av[V];
    load(g, i, gv);
    load(u, i, uv);
    for (int k = 0; k < V; ++k) av[k] = kmath::swiglu(gv[k], uv[k]);
    store(a, a16, i, av);
  }
}

template <int V>
__global__ void swiglu_backward_kernel(const float* da, const float* g, const float* u, float* dg,
                                       float* du, uint16_t* dg16, uint16_t* du16, int64_t n) {
  for (int64_t i = V * (blockIdx.x * int64_t{blockDim.x} + threadIdx.x); i < n;
       i += V * int64_t{gridDim.x} * blockDim.x) {
    float dav[V], gv[V], uv[V], dgv[V], duv[V];
    load(da, i, dav);  // every load before the stores: dg may alias da
    load(g, i, gv);
    load(u, i, uv);
    for (int k = 0; k < V; ++k) kmath::swiglu_grad(dav[k], gv[k], uv[k], dgv[k], duv[k]);
    store(dg, dg16, i, dgv);
    store(du, du16, i, duv);
  }
}

// One thread per V rotated pairs: (row, head, j .. j + V - 1 < head_dim / 2); V = 4 where the
// half head and every operand allow 16-byte loads (the bf16 output 8-byte stores).
template <int V>
__global__ void rope_kernel(float* x, uint16_t* x16, int64_t rows, int64_t seq, int64_t heads,
                            int64_t head_dim, const float* cos, const float* sin, float sign) {
  const int64_t half = head_dim / 2, n = rows * heads * half;
  for (int64_t i = V * (blockIdx.x * int64_t{blockDim.x} + threadIdx.x); i < n;
       i += V * int64_t{gridDim.x} * blockDim.x) {
    const int64_t j = i % half, rh = i / half, r = rh / heads;
    const int64_t at = rh * head_dim + j, t = (r % seq) * half + j;
    float x1[V], x2[V], c[V], sn[V];
    load(x, at, x1);
    load(x, at + half, x2);
    load(cos, t, c);
    load(sin, t, sn);
    for (int k = 0; k < V; ++k) kmath::rope_rotate(x1[k], x2[k], c[k], sign * sn[k], x1[k], x2[k]);
    store(x, nullptr, at, x1);
    store(x, nullptr, at + half, x2);
    if (x16 != nullptr) {
      store(nullptr, x16, at, x1);
      store(nullptr, x16, at + half, x2);
    }
  }
}

// --- embedding -------------------------------------------------------------------------------

__global__ void embedding_forward_kernel(const void* table, DType t, const int32_t* ids, int64_t n,
                                         int64_t hidden, float* out) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n * hidden;
       i += int64_t{gridDim.x} * blockDim.x)
    out[i] = load_as_fp32(table, t, int64_t{ids[i / hidden]} * hidden + i % hidden);
}

// Block (g, c): group g's id, columns [c * blockDim, (c + 1) * blockDim); its tokens in order.
__global__ void embedding_backward_kernel(const int32_t* order, const int32_t* start,
                                          const int32_t* id, const float* dy, int64_t hidden,
                                          float* grad) {
  const int64_t g = blockIdx.x;
  const int64_t j = blockIdx.y * int64_t{blockDim.x} + threadIdx.x;
  if (j >= hidden) return;
  float* row = grad + int64_t{id[g]} * hidden;
  float acc = row[j];
  for (int32_t k = start[g]; k < start[g + 1]; ++k) acc += dy[int64_t{order[k]} * hidden + j];
  row[j] = acc;
}

// --- RMSNorm ---------------------------------------------------------------------------------

// RMSNorm (block_kernels.hpp): a block per row for y and dx; dw in tiles of columns over ranges
// of rows, the ranges then added in order.
__global__ void rmsnorm_forward_kernel(const float* x, const float* w, float eps, int64_t dim,
                                       float* y, uint16_t* y16, float* rstd) {
  Thread<blocks::kReduceShared> t;
  blocks::rmsnorm_forward_row(t, x, w, eps, dim, y, y16, rstd);
}

__global__ void rmsnorm_dx_kernel(const float* dy, const float* x, const float* w,
                                  const float* rstd, int64_t dim, float* dx) {
  Thread<blocks::kReduceShared> t;
  blocks::rmsnorm_dx_row(t, dy, x, w, rstd, dim, dx);
}

// The block is the largest there is, so that few blocks keep enough loads in flight.
constexpr int kDwThreads = blocks::kDwThreads;

__global__ void __launch_bounds__(kDwThreads)
    rmsnorm_dw_kernel(const float* dy, const float* x, const float* rstd, int64_t rows,
                      int64_t rows_per_range, int64_t dim, float* dw, float* partials) {
  Thread<blocks::kDwShared> t;
  blocks::rmsnorm_dw_tile(t, dy, x, rstd, rows, rows_per_range, dim, dw, partials);
}

__global__ void rmsnorm_dw_ranges_kernel(const float* partials, int64_t ranges, int64_t dim,
                                         float* dw) {
  Thread<1> t;
  blocks::rmsnorm_dw_ranges(t, partials, ranges, dim, dw);
}

// --- attention softmax: one block per (matrix, row) ------------------------------------------

__global__ void causal_softmax_forward_kernel(float* scores, float* lse, int64_t rows, int64_t keys,
                                              int64_t first_query, int64_t lse_stride,
                                              float* inv_sum) {
  Thread<blocks::kReduceShared> t;
  blocks::causal_softmax_forward_row(t, scores, lse, rows, keys, first_query, lse_stride, inv_sum);
}

__global__ void causal_softmax_backward_kernel(float* scores, float* dp, const float* lse,
                                               int64_t rows, int64_t keys, int64_t first_query,
                                               int64_t lse_stride, const float* delta) {
  Thread<blocks::kReduceShared> t;
  blocks::causal_softmax_backward_row(t, scores, dp, lse, rows, keys, first_query, lse_stride,
                                      delta);
}

// --- cross-entropy: one block per row --------------------------------------------------------

__global__ void cross_entropy_kernel(float* logits, const int32_t* targets, int64_t vocab,
                                     float coef, bool grad, float* row_loss, uint16_t* grad_bf16) {
  Thread<blocks::kReduceShared> t;
  blocks::cross_entropy_row(t, logits, targets, vocab, coef, grad, row_loss, grad_bf16);
}

// --- gradient checks -------------------------------------------------------------------------

__global__ void sum_squares_partials_kernel(const float* x, int64_t n, float* partials) {
  Thread<blocks::kReduceShared> t;
  blocks::sum_squares_partials(t, x, n, partials);
}

__global__ void sum_partials_kernel(const float* partials, int count, float* out) {
  Thread<blocks::kReduceShared> t;
  blocks::sum_partials(t, partials, count, out);
}

__global__ void count_nonfinite_kernel(const float* x, int64_t n, unsigned int* count) {
  unsigned int c = 0;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    c += kmath::nonfinite(x[i]) ? 1u : 0u;
  if (c != 0) atomicAdd(count, c);
}

// The gradient norm's block sums (block_kernels.hpp): a half-warp per block of elements; the
// grid covers whole warps (kThreads a multiple of 32), so every lane takes part in the shuffles.
__global__ void block_sums_of_squares_kernel(const float* x, int64_t n, int64_t block,
                                             int64_t count, double* out) {
  Thread<1> t;
  blocks::block_sums_of_squares(t, x, n, block, count, out);
}

// --- optimizer -------------------------------------------------------------------------------

// kmath::adam_at over a grid-stride loop.
template <int M, int Formula, int O>
__global__ void adam_kernel(cpu_adam::detail::AdamCoeffs c, int64_t n, float* p, const float* g,
                            void* m, void* v, void* out) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x)
    kmath::adam_at<M, Formula, O>(c, i, p, g, m, v, out);
}

template <int M, int Formula>
void launch_adam(const cpu_adam::detail::AdamCoeffs& c, int64_t n, float* p, const float* g,
                 void* m, void* v, void* out, DType out_dtype, cudaStream_t s) {
  using namespace cpu_adam::detail;
  if (out == nullptr)
    adam_kernel<M, Formula, kOutNone><<<grid_for(n), kThreads, 0, s>>>(c, n, p, g, m, v, out);
  else if (out_dtype == DType::BF16)
    adam_kernel<M, Formula, kOutBF16><<<grid_for(n), kThreads, 0, s>>>(c, n, p, g, m, v, out);
  else
    adam_kernel<M, Formula, kOutF16><<<grid_for(n), kThreads, 0, s>>>(c, n, p, g, m, v, out);
}

// The caller's thread may never have made the stream's GPU current (the optimizer's threads):
// a kernel launches only on the current device's streams.
void make_stream_device_current(StreamHandle s) {
  if (s == nullptr) return;
  int ordinal = 0;
  CUDA_CHECK(cudaStreamGetDevice(native(s), &ordinal));
  CUDA_CHECK(cudaSetDevice(ordinal));
}

void check_rows(int64_t rows, const char* what) {
  if (rows > int64_t{0x7fffffff})
    throw InvalidArgument(std::string(what) + ": " + std::to_string(rows) +
                          " rows exceed one launch's grid");
}

}  // namespace

void to_fp32(const void* src, DType dtype, float* dst, int64_t n, StreamHandle s) {
  if (n == 0) return;
  if (dtype != DType::F32 && on_16_bytes(src, dst))
    to_fp32_x8_kernel<<<grid_for((n + 7) / 8), kThreads, 0, native(s)>>>(
        static_cast<const uint4*>(src), dtype, reinterpret_cast<float4*>(dst), n);
  else
    to_fp32_kernel<<<grid_for(n), kThreads, 0, native(s)>>>(src, dtype, dst, n);
  LAUNCHED();
}

void from_fp32(const float* src, void* dst, DType dtype, int64_t n, StreamHandle s) {
  if (n == 0) return;
  if (dtype != DType::F32 && on_16_bytes(src, dst))
    from_fp32_x8_kernel<<<grid_for((n + 7) / 8), kThreads, 0, native(s)>>>(
        reinterpret_cast<const float4*>(src), static_cast<uint4*>(dst), dtype, n);
  else
    from_fp32_kernel<<<grid_for(n), kThreads, 0, native(s)>>>(src, dst, dtype, n);
  LAUNCHED();
}

void scale_rows(float* x, int64_t rows, int64_t cols, int64_t ld, const float* scale,
                StreamHandle s) {
  if (rows == 0 || cols == 0) return;
  check_rows(rows, "scale_rows");
  scale_rows_kernel<<<static_cast<unsigned>(rows), kThreads, 0, native(s)>>>(x, cols, ld, scale);
  LAUNCHED();
}

void add_inplace(float* y, const float* x, int64_t n, StreamHandle s) {
  if (n == 0) return;
  if (four_at_a_time(n, {y, x}, {}))
    add_kernel<4><<<grid_for(n / 4), kThreads, 0, native(s)>>>(y, x, n);
  else
    add_kernel<1><<<grid_for(n), kThreads, 0, native(s)>>>(y, x, n);
  LAUNCHED();
}

void swiglu_forward(const float* g, const float* u, float* a, int64_t n, StreamHandle s,
                    uint16_t* a_bf16) {
  if (n == 0) return;
  if (four_at_a_time(n, {g, u, a_bf16 ? nullptr : a}, {a_bf16}))
    swiglu_forward_kernel<4><<<grid_for(n / 4), kThreads, 0, native(s)>>>(g, u, a, a_bf16, n);
  else
    swiglu_forward_kernel<1><<<grid_for(n), kThreads, 0, native(s)>>>(g, u, a, a_bf16, n);
  LAUNCHED();
}

void swiglu_backward(const float* da, const float* g, const float* u, float* dg, float* du,
                     int64_t n, StreamHandle s, uint16_t* dg_bf16, uint16_t* du_bf16) {
  if (n == 0) return;
  if (four_at_a_time(n, {da, g, u, dg_bf16 ? nullptr : dg, du_bf16 ? nullptr : du},
                     {dg_bf16, du_bf16}))
    swiglu_backward_kernel<4>
        <<<grid_for(n / 4), kThreads, 0, native(s)>>>(da, g, u, dg, du, dg_bf16, du_bf16, n);
  else
    swiglu_backward_kernel<1>
        <<<grid_for(n), kThreads, 0, native(s)>>>(da, g, u, dg, du, dg_bf16, du_bf16, n);
  LAUNCHED();
}

void rope(float* x, int64_t rows, int64_t seq, int64_t heads, int64_t head_dim, const float* cos,
          const float* sin, bool inverse, StreamHandle s, uint16_t* x_bf16) {
  const int64_t half = head_dim / 2, n = rows * heads * half;
  if (n == 0) return;
  const float sign = inverse ? -1.0f : 1.0f;
  if (four_at_a_time(half, {x, cos, sin}, {x_bf16}))
    rope_kernel<4><<<grid_for(n / 4), kThreads, 0, native(s)>>>(x, x_bf16, rows, seq, heads,
                                                                head_dim, cos, sin, sign);
  else
    rope_kernel<1><<<grid_for(n), kThreads, 0, native(s)>>>(x, x_bf16, rows, seq, heads, head_dim,
                                                            cos, sin, sign);
  LAUNCHED();
}

void embedding_forward(const void* table, DType dtype, const int32_t* ids, int64_t n,
                       int64_t hidden, float* out, StreamHandle s) {
  if (n * hidden == 0) return;
  embedding_forward_kernel<<<grid_for(n * hidden), kThreads, 0, native(s)>>>(table, dtype, ids, n,
                                                                             hidden, out);
  LAUNCHED();
}

void embedding_backward(const int32_t* groups, int64_t n, int64_t num_groups, const float* dy,
                        int64_t hidden, float* grad, StreamHandle s) {
  if (n * hidden == 0 || num_groups == 0) return;
  if (num_groups > 0x7fffffff || (hidden + kThreads - 1) / kThreads > 65535)
    throw InvalidArgument("embedding_backward: too many token groups or columns");
  const dim3 grid(static_cast<unsigned>(num_groups),
                  static_cast<unsigned>((hidden + kThreads - 1) / kThreads));
  embedding_backward_kernel<<<grid, kThreads, 0, native(s)>>>(
      groups, groups + n, groups + n + num_groups + 1, dy, hidden, grad);
  LAUNCHED();
}

void rmsnorm_forward(const float* x, const float* w, float eps, int64_t rows, int64_t dim, float* y,
                     float* rstd, StreamHandle s, uint16_t* y_bf16) {
  if (rows == 0) return;
  check_rows(rows, "rmsnorm_forward");
  rmsnorm_forward_kernel<<<static_cast<unsigned>(rows), kThreads, 0, native(s)>>>(x, w, eps, dim, y,
                                                                                  y_bf16, rstd);
  LAUNCHED();
}

void rmsnorm_backward(const float* dy, const float* x, const float* w, const float* rstd,
                      int64_t rows, int64_t dim, float* dx, float* dw, float* dw_partials,
                      StreamHandle s) {
  if (rows == 0 || dim == 0) return;
  check_rows(rows, "rmsnorm_backward");
  rmsnorm_dx_kernel<<<static_cast<unsigned>(rows), kThreads, 0, native(s)>>>(dy, x, w, rstd, dim,
                                                                             dx);
  LAUNCHED();
  norm::DwSplit split = norm::dw_split(rows, dim);
  if (dw_partials == nullptr) split.ranges = 1, split.rows_per_range = rows;
  if (split.tiles > 0x7fffffff) throw InvalidArgument("rmsnorm_backward: too many columns");
  const dim3 grid(static_cast<unsigned>(split.tiles), static_cast<unsigned>(split.ranges));
  float* partials = split.ranges > 1 ? dw_partials : nullptr;
  rmsnorm_dw_kernel<<<grid, kDwThreads, 0, native(s)>>>(dy, x, rstd, rows, split.rows_per_range,
                                                        dim, dw, partials);
  LAUNCHED();
  if (partials == nullptr) return;
  rmsnorm_dw_ranges_kernel<<<grid_for(dim), kThreads, 0, native(s)>>>(partials, split.ranges, dim,
                                                                      dw);
  LAUNCHED();
}

void causal_softmax_forward(float* scores, float* lse, int64_t batch, int64_t rows, int64_t keys,
                            int64_t first_query, StreamHandle s, int64_t lse_stride,
                            float* inv_sum) {
  if (batch * rows == 0) return;
  if (first_query + rows > keys)
    throw InvalidArgument("causal_softmax_forward: queries beyond the keys");
  check_rows(batch * rows, "causal_softmax_forward");
  causal_softmax_forward_kernel<<<static_cast<unsigned>(batch * rows), kThreads, 0, native(s)>>>(
      scores, lse, rows, keys, first_query, lse_stride > 0 ? lse_stride : rows, inv_sum);
  LAUNCHED();
}

void causal_softmax_backward(float* scores, float* dp, const float* lse, int64_t batch,
                             int64_t rows, int64_t keys, int64_t first_query, StreamHandle s,
                             int64_t lse_stride, const float* delta) {
  if (batch * rows == 0) return;
  if (first_query + rows > keys)
    throw InvalidArgument("causal_softmax_backward: queries beyond the keys");
  check_rows(batch * rows, "causal_softmax_backward");
  causal_softmax_backward_kernel<<<static_cast<unsigned>(batch * rows), kThreads, 0, native(s)>>>(
      scores, dp, lse, rows, keys, first_query, lse_stride > 0 ? lse_stride : rows, delta);
  LAUNCHED();
}

// --- attention's D: a thread per (token, head) row ------------------------------------------

// With kWords, a row's values come eight at a time in 16-byte loads (hd a multiple of 8, both
// matrices on 16 bytes) and are added in the same order as bf16_row_dot adds them.
template <bool kWords>
__global__ void attention_delta_kernel(const uint16_t* attn, const uint16_t* dattn, int64_t rows,
                                       int64_t T, int64_t nh, int64_t hd, float* delta) {
  const int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;  // token r / nh, head r % nh
  if (r >= rows) return;
  const int64_t token = r / nh, h = r % nh, at = r * hd;
  float sum = 0.0f;
  if constexpr (kWords) {
    const auto* a = reinterpret_cast<const uint4*>(attn + at);
    const auto* b = reinterpret_cast<const uint4*>(dattn + at);
    for (int64_t c = 0; c < hd / 8; ++c) {
      const uint4 x = a[c], y = b[c];
      sum = kmath::bf16_row_dot_pair(sum, x.x, y.x);
      sum = kmath::bf16_row_dot_pair(sum, x.y, y.y);
      sum = kmath::bf16_row_dot_pair(sum, x.z, y.z);
      sum = kmath::bf16_row_dot_pair(sum, x.w, y.w);
    }
  } else {
    sum = kmath::bf16_row_dot(attn + at, dattn + at, hd);
  }
  delta[(token / T * nh + h) * T + token % T] = sum;
}

void attention_delta(const uint16_t* attn, const uint16_t* dattn, int64_t B, int64_t T, int64_t nh,
                     int64_t hd, float* delta, StreamHandle s) {
  const int64_t rows = B * T * nh;
  if (rows == 0) return;
  const int64_t blocks = (rows + kThreads - 1) / kThreads;
  check_rows(blocks, "attention_delta");
  if (hd % 8 == 0 && on_16_bytes(attn, dattn))
    attention_delta_kernel<true><<<static_cast<unsigned>(blocks), kThreads, 0, native(s)>>>(
        attn, dattn, rows, T, nh, hd, delta);
  else
    attention_delta_kernel<false><<<static_cast<unsigned>(blocks), kThreads, 0, native(s)>>>(
        attn, dattn, rows, T, nh, hd, delta);
  LAUNCHED();
}

void cross_entropy(float* logits, const int32_t* targets, int64_t rows, int64_t vocab, float coef,
                   bool grad, float* row_loss, StreamHandle s, uint16_t* grad_bf16) {
  if (rows == 0) return;
  check_rows(rows, "cross_entropy");
  cross_entropy_kernel<<<static_cast<unsigned>(rows), kThreads, 0, native(s)>>>(
      logits, targets, vocab, coef, grad, row_loss, grad_bf16);
  LAUNCHED();
}

void sum_squares(const float* x, int64_t n, float* partials, float* out, StreamHandle s) {
  sum_squares_partials_kernel<<<kSumSquaresPartials, kThreads, 0, native(s)>>>(x, n, partials);
  LAUNCHED();
  sum_partials_kernel<<<1, kThreads, 0, native(s)>>>(partials, kSumSquaresPartials, out);
  LAUNCHED();
}

void block_sums_of_squares(const float* x, int64_t n, int64_t block, double* out, StreamHandle s) {
  if (block <= 0) throw InvalidArgument("block_sums_of_squares: block size must be > 0");
  if (n <= 0) return;
  make_stream_device_current(s);
  const int64_t blocks = (n + block - 1) / block;
  const int64_t grid = (blocks * cpu_adam::math::kSquareLanes + kThreads - 1) / kThreads;
  static_assert(kThreads % 32 == 0);
  if (grid > int64_t{0x7fffffff})
    throw InvalidArgument("block_sums_of_squares: " + std::to_string(blocks) +
                          " blocks exceed one launch's grid");
  block_sums_of_squares_kernel<<<static_cast<unsigned>(grid), kThreads, 0, native(s)>>>(
      x, n, block, blocks, out);
  LAUNCHED();
}

void adam_step(const cpu_adam::detail::AdamCoeffs& c, bool pytorch, int64_t n, float* params,
               const float* grads, void* exp_avg, void* exp_avg_sq, bool bf16_moments, void* out,
               DType out_dtype, StreamHandle s) {
  using namespace cpu_adam::detail;
  if (out != nullptr && out_dtype != DType::BF16 && out_dtype != DType::F16)
    throw InvalidArgument("adam_step: the parameter copy-out must be bf16 or fp16");
  if (n == 0) return;
  make_stream_device_current(s);
  if (bf16_moments && pytorch)
    launch_adam<kBF16, kPyTorch>(c, n, params, grads, exp_avg, exp_avg_sq, out, out_dtype,
                                 native(s));
  else if (bf16_moments)
    launch_adam<kBF16, kDeepSpeed>(c, n, params, grads, exp_avg, exp_avg_sq, out, out_dtype,
                                   native(s));
  else if (pytorch)
    launch_adam<kF32, kPyTorch>(c, n, params, grads, exp_avg, exp_avg_sq, out, out_dtype,
                                native(s));
  else
    launch_adam<kF32, kDeepSpeed>(c, n, params, grads, exp_avg, exp_avg_sq, out, out_dtype,
                                  native(s));
  LAUNCHED();
}

void count_nonfinite(const float* x, int64_t n, unsigned int* count, StreamHandle s) {
  if (n == 0) return;
  count_nonfinite_kernel<<<grid_for(n), kThreads, 0, native(s)>>>(x, n, count);
  LAUNCHED();
}

}  // namespace outcore::device::cuda
