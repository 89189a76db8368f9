// Fused causal attention with bf16 operands (see cuda_kernels.hpp): tiles of 64 queries x 64
// keys in shared memory, products on tensor cores (WMMA, bf16 in, fp32 accumulation), no score
// matrix in device memory. The rounding points are the default attention's
// (compute_backend.hpp): probabilities exp(s - max) / sum and score gradients are rounded to bf16
// before the products that read them, with the row's final max and sum, which is why the forward
// makes two passes over the keys (the first finds each row's max and sum online, the second
// forms the probabilities and multiplies them by v) and the backward finds D = sum(p * dp) per
// row before any score gradient is formed. Per element the arithmetic is kernel_math.hpp's.
//
// Work split, each output written by one block (deterministic, no atomics):
//   forward      one block per (head, query tile, sequence);
//   backward dq  one block per (head, query tile, sequence): D, then dq = scale * ds k;
//   backward dkv one block per (kv head, key tile, sequence), over the heads of its group and
//                the query tiles at or after the key tile: dk += scale * ds^T q, dv += p^T dattn.
// Blocks start costliest first, as in flash_attention_tiles.hpp: the grid's y runs over tiles,
// and forward and dq blocks take their query tiles from the last.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <cstdint>
#include <string>

#include "common/error.hpp"
#include "engine/device/cuda/cuda_check.hpp"
#include "engine/device/cuda/cuda_kernels.hpp"
#include "engine/device/flash_attention_tiles.hpp"
#include "engine/device/kernel_math.hpp"

namespace outcore::device::cuda {
namespace {

namespace wmma = nvcuda::wmma;
using bf16 = __nv_bfloat16;

constexpr int kTile = 64;              // queries per tile = keys per tile
constexpr int kWarps = 4;              // each warp owns 16 rows of a tile
constexpr int kThreads = 32 * kWarps;  // two threads per row for the row-wise steps
constexpr int kPadH = 8;               // bf16 row padding (16 bytes)
constexpr int kPadF = 4;               // fp32 row padding (16 bytes)
constexpr int kLdS = kTile + kPadF;    // fp32 score tiles
constexpr int kLdP = kTile + kPadH;    // bf16 probability / score-gradient tiles
static_assert(kTile == 16 * kWarps, "a warp per 16 rows");

using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major>;
using FragAT = wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::col_major>;
using FragB = wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major>;
using FragBT = wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major>;
using FragC = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

using Geometry = flash::Geometry;  // shapes shared by the kernels of one launch

template <int HD>
struct Layout {
  static constexpr int kLdH = HD + kPadH;  // bf16 [64][HD] tiles
  static constexpr int kLdO = HD + kPadF;  // fp32 [64][HD] staging
  static constexpr size_t kHalfTile = size_t(kTile) * kLdH * sizeof(uint16_t);
  static constexpr size_t kScoreTile = size_t(kTile) * kLdS * sizeof(float);
  static constexpr size_t kLowpTile = size_t(kTile) * kLdP * sizeof(uint16_t);
  static constexpr size_t kRowVec = size_t(kTile) * sizeof(float);
  static constexpr size_t kStage = size_t(kTile) * kLdO * sizeof(float);
  static_assert(kStage <= 2 * kHalfTile, "the output staging fits in two bf16 tiles");
  // forward: Q, K, V, S, P, and the output staging over K and V
  static constexpr size_t kForward = 3 * kHalfTile + kScoreTile + kLowpTile;
  // dq: Q, dO, K, V, S, dP, dS, and dq's staging over K and V
  static constexpr size_t kDq = 4 * kHalfTile + 2 * kScoreTile + kLowpTile;
  // dkv: K, V, Q, dO, S, dP, P, dS, lse, D, and the staging over Q and dO
  static constexpr size_t kDkv = 4 * kHalfTile + 2 * kScoreTile + 2 * kLowpTile + 2 * kRowVec;
};

// rows [row0, row0 + 64) of a token-major bf16 matrix (row r at src + r * ld, HD contiguous
// elements) into a [64][HD + 8] tile; rows at or beyond `rows` become zeros. 16-byte copies.
template <int HD>
__device__ void load_tile(uint16_t* tile, const uint16_t* src, int64_t ld, int row0, int rows) {
  constexpr int kVecs = HD / 8;  // 8 bf16 per 16 bytes
  for (int i = threadIdx.x; i < kTile * kVecs; i += kThreads) {
    const int r = i / kVecs, c = i % kVecs;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (row0 + r < rows) v = *reinterpret_cast<const uint4*>(src + (row0 + r) * ld + c * 8);
    *reinterpret_cast<uint4*>(tile + r * Layout<HD>::kLdH + c * 8) = v;
  }
}

// out[64 x 64] (fp32, ld kLdS) = a[64 x HD] b[64 x HD]^T; warp w computes rows 16w..16w+15.
template <int HD>
__device__ void product_abt(const uint16_t* a, const uint16_t* b, float* out) {
  constexpr int ld = Layout<HD>::kLdH;
  const int w = threadIdx.x / 32;
  FragC acc[kTile / 16];
  for (auto& f : acc) wmma::fill_fragment(f, 0.0f);
  for (int kk = 0; kk < HD; kk += 16) {
    FragA fa;
    wmma::load_matrix_sync(fa, reinterpret_cast<const bf16*>(a + 16 * w * ld + kk), ld);
    for (int n = 0; n < kTile / 16; ++n) {
      FragBT fb;  // b^T: element (kk, n) at b[n][kk]
      wmma::load_matrix_sync(fb, reinterpret_cast<const bf16*>(b + 16 * n * ld + kk), ld);
      wmma::mma_sync(acc[n], fa, fb, acc[n]);
    }
  }
  for (int n = 0; n < kTile / 16; ++n)
    wmma::store_matrix_sync(out + 16 * w * kLdS + 16 * n, acc[n], kLdS, wmma::mem_row_major);
}

// acc[HD / 16] (warp w's rows 16w..) += p[64 x 64] (bf16, ld kLdP) x b[64 x HD] (bf16).
template <int HD>
__device__ void product_pb(FragC (&acc)[HD / 16], const uint16_t* p, const uint16_t* b) {
  constexpr int ld = Layout<HD>::kLdH;
  const int w = threadIdx.x / 32;
  for (int kk = 0; kk < kTile; kk += 16) {
    FragA fa;
    wmma::load_matrix_sync(fa, reinterpret_cast<const bf16*>(p + 16 * w * kLdP + kk), kLdP);
    for (int n = 0; n < HD / 16; ++n) {
      FragB fb;
      wmma::load_matrix_sync(fb, reinterpret_cast<const bf16*>(b + kk * ld + 16 * n), ld);
      wmma::mma_sync(acc[n], fa, fb, acc[n]);
    }
  }
}

// acc[HD / 16] (warp w's key rows 16w..) += p[64 x 64]^T (bf16, ld kLdP) x b[64 x HD] (bf16).
template <int HD>
__device__ void product_ptb(FragC (&acc)[HD / 16], const uint16_t* p, const uint16_t* b) {
  constexpr int ld = Layout<HD>::kLdH;
  const int w = threadIdx.x / 32;
  for (int kk = 0; kk < kTile; kk += 16) {
    FragAT fa;  // p^T: element (m, kk) at p[kk][m]
    wmma::load_matrix_sync(fa, reinterpret_cast<const bf16*>(p + kk * kLdP + 16 * w), kLdP);
    for (int n = 0; n < HD / 16; ++n) {
      FragB fb;
      wmma::load_matrix_sync(fb, reinterpret_cast<const bf16*>(b + kk * ld + 16 * n), ld);
      wmma::mma_sync(acc[n], fa, fb, acc[n]);
    }
  }
}

// Stores warp w's accumulators (rows 16w..) into a [64][HD + 4] fp32 staging tile.
template <int HD>
__device__ void stage(float* staging, FragC (&acc)[HD / 16]) {
  const int w = threadIdx.x / 32;
  for (int n = 0; n < HD / 16; ++n)
    wmma::store_matrix_sync(staging + 16 * w * Layout<HD>::kLdO + 16 * n, acc[n], Layout<HD>::kLdO,
                            wmma::mem_row_major);
}

// The row-wise steps: thread t works on row t / 2, on 32 of its 64 columns (the pair's other
// thread has the rest), visiting them in a rotated order so that a warp's rows fall in distinct
// banks.
struct RowPart {
  int row, col0, rot;
  __device__ RowPart() : row(threadIdx.x / 2), col0((threadIdx.x % 2) * 32), rot(row & 31) {}
  __device__ int col(int i) const { return col0 + ((i + rot) & 31); }
};

__device__ float pair_max(float v) { return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1)); }
__device__ float pair_sum(float v) { return v + __shfl_xor_sync(0xffffffffu, v, 1); }

// --- forward -----------------------------------------------------------------------------------

template <int HD>
__global__ void __launch_bounds__(kThreads)
    flash_forward_kernel(const uint16_t* q, const uint16_t* k, const uint16_t* v, float* lse,
                         float* attn, Geometry g) {
  using L = Layout<HD>;
  extern __shared__ __align__(128) unsigned char smem[];
  uint16_t* Qs = reinterpret_cast<uint16_t*>(smem);
  uint16_t* Ks = reinterpret_cast<uint16_t*>(smem + L::kHalfTile);
  uint16_t* Vs = reinterpret_cast<uint16_t*>(smem + 2 * L::kHalfTile);
  float* Ss = reinterpret_cast<float*>(smem + 3 * L::kHalfTile);
  uint16_t* Ps = reinterpret_cast<uint16_t*>(smem + 3 * L::kHalfTile + L::kScoreTile);
  float* Os = reinterpret_cast<float*>(Ks);  // after the last tile

  const int q0 = (gridDim.y - 1 - blockIdx.y) * kTile, h = blockIdx.x, b = blockIdx.z;
  const int64_t Q = int64_t(g.nh) * HD, KV = int64_t(g.nkv) * HD;
  const uint16_t* qb = q + int64_t(b) * g.T * Q + int64_t(h) * HD;
  const uint16_t* kb = k + int64_t(b) * g.T * KV + int64_t(h / g.group) * HD;
  const uint16_t* vb = v + int64_t(b) * g.T * KV + int64_t(h / g.group) * HD;
  const int last = min(q0 + kTile, g.T) - 1;  // the tile's last query
  const int tiles = last / kTile + 1;         // key tiles at or below it
  const RowPart rp;
  const int t = q0 + rp.row;  // this thread's query

  load_tile<HD>(Qs, qb, Q, q0, g.T);
  // Pass 1: each row's max and sum of exp(s - max), online.
  float m = -INFINITY, sum = 0.0f;
  for (int kt = 0; kt < tiles; ++kt) {
    __syncthreads();
    load_tile<HD>(Ks, kb, KV, kt * kTile, g.T);
    __syncthreads();
    product_abt<HD>(Qs, Ks, Ss);
    __syncthreads();
    // Every thread takes part in the pair's shuffles; a row beyond T sees no valid key, and
    // its max and sum are never used.
    const float* s = Ss + rp.row * kLdS;
    float tile_max = -INFINITY;
    for (int i = 0; i < 32; ++i) {
      const int c = rp.col(i);
      if (t < g.T && kt * kTile + c <= t) tile_max = fmaxf(tile_max, g.scale * s[c]);
    }
    const float m_new = fmaxf(m, pair_max(tile_max));
    float part = 0.0f;
    for (int i = 0; i < 32; ++i) {
      const int c = rp.col(i);
      if (t < g.T && kt * kTile + c <= t) part += kmath::softmax_exp(g.scale * s[c], m_new);
    }
    part = pair_sum(part);
    if (t < g.T) sum = sum * kmath::softmax_exp(m, m_new) + part;  // exp(-inf) = 0 at the start
    m = m_new;
  }
  const float inv = 1.0f / sum;
  if (t < g.T && rp.col0 == 0) lse[(int64_t(b) * g.nh + h) * g.T + t] = kmath::softmax_lse(m, sum);

  // Pass 2: p = exp(s - max) / sum rounded to bf16, then attn += p v.
  FragC acc[HD / 16];
  for (auto& f : acc) wmma::fill_fragment(f, 0.0f);
  for (int kt = 0; kt < tiles; ++kt) {
    __syncthreads();
    load_tile<HD>(Ks, kb, KV, kt * kTile, g.T);
    load_tile<HD>(Vs, vb, KV, kt * kTile, g.T);
    __syncthreads();
    product_abt<HD>(Qs, Ks, Ss);
    __syncthreads();
    const float* s = Ss + rp.row * kLdS;
    uint16_t* p = Ps + rp.row * kLdP;
    for (int i = 0; i < 32; ++i) {
      const int c = rp.col(i);
      const bool valid = t < g.T && kt * kTile + c <= t;
      p[c] = valid ? kmath::fp32_to_bf16(kmath::softmax_exp(g.scale * s[c], m) * inv) : 0;
    }
    __syncthreads();
    product_pb<HD>(acc, Ps, Vs);
  }
  __syncthreads();
  stage<HD>(Os, acc);
  __syncthreads();
  for (int i = threadIdx.x; i < kTile * HD; i += kThreads) {
    const int r = i / HD, d = i % HD;
    if (q0 + r < g.T)
      attn[(int64_t(b) * g.T + q0 + r) * Q + int64_t(h) * HD + d] = Os[r * L::kLdO + d];
  }
}

// --- backward: dq and D ----------------------------------------------------------------------

template <int HD>
__global__ void __launch_bounds__(kThreads)
    flash_backward_dq_kernel(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                             const float* lse, const uint16_t* dattn, float* drow, float* dq,
                             Geometry g) {
  using L = Layout<HD>;
  extern __shared__ __align__(128) unsigned char smem[];
  uint16_t* Qs = reinterpret_cast<uint16_t*>(smem);
  uint16_t* Ds = reinterpret_cast<uint16_t*>(smem + L::kHalfTile);  // dattn rows
  uint16_t* Ks = reinterpret_cast<uint16_t*>(smem + 2 * L::kHalfTile);
  uint16_t* Vs = reinterpret_cast<uint16_t*>(smem + 3 * L::kHalfTile);
  float* Ss = reinterpret_cast<float*>(smem + 4 * L::kHalfTile);
  float* DPs = reinterpret_cast<float*>(smem + 4 * L::kHalfTile + L::kScoreTile);
  uint16_t* DSs = reinterpret_cast<uint16_t*>(smem + 4 * L::kHalfTile + 2 * L::kScoreTile);
  float* Os = reinterpret_cast<float*>(Ks);

  const int q0 = (gridDim.y - 1 - blockIdx.y) * kTile, h = blockIdx.x, b = blockIdx.z;
  const int64_t Q = int64_t(g.nh) * HD, KV = int64_t(g.nkv) * HD;
  const int64_t q_at = int64_t(b) * g.T * Q + int64_t(h) * HD;
  const uint16_t* kb = k + int64_t(b) * g.T * KV + int64_t(h / g.group) * HD;
  const uint16_t* vb = v + int64_t(b) * g.T * KV + int64_t(h / g.group) * HD;
  const int last = min(q0 + kTile, g.T) - 1;
  const int tiles = last / kTile + 1;
  const RowPart rp;
  const int t = q0 + rp.row;
  const int64_t row_at = (int64_t(b) * g.nh + h) * g.T + t;
  const float l = t < g.T ? lse[row_at] : 0.0f;

  // Key tile kt's scores and probability gradients (q k^T, dattn v^T) into Ss and DPs.
  auto scores = [&](int kt) {
    __syncthreads();
    load_tile<HD>(Ks, kb, KV, kt * kTile, g.T);
    load_tile<HD>(Vs, vb, KV, kt * kTile, g.T);
    __syncthreads();
    product_abt<HD>(Qs, Ks, Ss);
    product_abt<HD>(Ds, Vs, DPs);
    __syncthreads();
  };
  load_tile<HD>(Qs, q + q_at, Q, q0, g.T);
  load_tile<HD>(Ds, dattn + q_at, Q, q0, g.T);
  // Pass 1: D = sum over keys of p * dp, p = exp(s - lse) in fp32.
  float dot = 0.0f;
  for (int kt = 0; kt < tiles; ++kt) {
    scores(kt);
    const float* s = Ss + rp.row * kLdS;
    const float* dp = DPs + rp.row * kLdS;
    for (int i = 0; i < 32; ++i) {
      const int c = rp.col(i);
      if (t < g.T && kt * kTile + c <= t) dot += kmath::softmax_exp(g.scale * s[c], l) * dp[c];
    }
  }
  dot = pair_sum(dot);
  if (t < g.T && rp.col0 == 0) drow[row_at] = dot;

  // Pass 2: ds = p (dp - D) rounded to bf16; dq = scale * ds k.
  FragC acc[HD / 16];
  for (auto& f : acc) wmma::fill_fragment(f, 0.0f);
  for (int kt = 0; kt < tiles; ++kt) {
    scores(kt);
    const float* s = Ss + rp.row * kLdS;
    const float* dp = DPs + rp.row * kLdS;
    uint16_t* ds = DSs + rp.row * kLdP;
    for (int i = 0; i < 32; ++i) {
      const int c = rp.col(i);
      const bool valid = t < g.T && kt * kTile + c <= t;
      ds[c] = valid ? kmath::fp32_to_bf16(
                          kmath::softmax_grad(kmath::softmax_exp(g.scale * s[c], l), dp[c], dot))
                    : 0;
    }
    __syncthreads();
    product_pb<HD>(acc, DSs, Ks);
  }
  __syncthreads();
  stage<HD>(Os, acc);
  __syncthreads();
  for (int i = threadIdx.x; i < kTile * HD; i += kThreads) {
    const int r = i / HD, d = i % HD;
    if (q0 + r < g.T) dq[q_at + int64_t(q0 + r) * Q + d] = g.scale * Os[r * L::kLdO + d];
  }
}

// --- backward: dk and dv ---------------------------------------------------------------------

template <int HD>
__global__ void __launch_bounds__(kThreads)
    flash_backward_dkv_kernel(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                              const float* lse, const uint16_t* dattn, const float* drow, float* dk,
                              float* dv, Geometry g) {
  using L = Layout<HD>;
  extern __shared__ __align__(128) unsigned char smem[];
  uint16_t* Ks = reinterpret_cast<uint16_t*>(smem);
  uint16_t* Vs = reinterpret_cast<uint16_t*>(smem + L::kHalfTile);
  uint16_t* Qs = reinterpret_cast<uint16_t*>(smem + 2 * L::kHalfTile);
  uint16_t* Ds = reinterpret_cast<uint16_t*>(smem + 3 * L::kHalfTile);
  float* Ss = reinterpret_cast<float*>(smem + 4 * L::kHalfTile);
  float* DPs = reinterpret_cast<float*>(smem + 4 * L::kHalfTile + L::kScoreTile);
  uint16_t* Ps = reinterpret_cast<uint16_t*>(smem + 4 * L::kHalfTile + 2 * L::kScoreTile);
  uint16_t* DSs = Ps + kTile * kLdP;
  float* lse_s =
      reinterpret_cast<float*>(smem + 4 * L::kHalfTile + 2 * L::kScoreTile + 2 * L::kLowpTile);
  float* d_s = lse_s + kTile;
  float* Os = reinterpret_cast<float*>(Qs);  // after the last tile

  const int k0 = blockIdx.y * kTile, gkv = blockIdx.x, b = blockIdx.z;
  const int64_t Q = int64_t(g.nh) * HD, KV = int64_t(g.nkv) * HD;
  const int64_t kv_at = int64_t(b) * g.T * KV + int64_t(gkv) * HD;
  const int q_tiles = (g.T + kTile - 1) / kTile;
  const RowPart rp;

  load_tile<HD>(Ks, k + kv_at, KV, k0, g.T);
  load_tile<HD>(Vs, v + kv_at, KV, k0, g.T);
  FragC dk_acc[HD / 16], dv_acc[HD / 16];
  for (auto& f : dk_acc) wmma::fill_fragment(f, 0.0f);
  for (auto& f : dv_acc) wmma::fill_fragment(f, 0.0f);
  for (int j = 0; j < g.group; ++j) {
    const int h = gkv * g.group + j;
    const int64_t q_at = int64_t(b) * g.T * Q + int64_t(h) * HD;
    const int64_t rows_at = (int64_t(b) * g.nh + h) * g.T;
    for (int qt = k0 / kTile; qt < q_tiles; ++qt) {
      const int q0 = qt * kTile;
      __syncthreads();
      load_tile<HD>(Qs, q + q_at, Q, q0, g.T);
      load_tile<HD>(Ds, dattn + q_at, Q, q0, g.T);
      for (int r = threadIdx.x; r < kTile; r += kThreads) {
        lse_s[r] = q0 + r < g.T ? lse[rows_at + q0 + r] : 0.0f;
        d_s[r] = q0 + r < g.T ? drow[rows_at + q0 + r] : 0.0f;
      }
      __syncthreads();
      product_abt<HD>(Qs, Ks, Ss);
      product_abt<HD>(Ds, Vs, DPs);
      __syncthreads();
      // Row-wise over queries: p rounded for dv, ds rounded for dk.
      const int t = q0 + rp.row;
      const float* s = Ss + rp.row * kLdS;
      const float* dp = DPs + rp.row * kLdS;
      uint16_t* p = Ps + rp.row * kLdP;
      uint16_t* ds = DSs + rp.row * kLdP;
      for (int i = 0; i < 32; ++i) {
        const int c = rp.col(i);
        const bool valid = t < g.T && k0 + c <= t;
        const float pf = valid ? kmath::softmax_exp(g.scale * s[c], lse_s[rp.row]) : 0.0f;
        p[c] = valid ? kmath::fp32_to_bf16(pf) : 0;
        ds[c] = valid ? kmath::fp32_to_bf16(kmath::softmax_grad(pf, dp[c], d_s[rp.row])) : 0;
      }
      __syncthreads();
      product_ptb<HD>(dv_acc, Ps, Ds);
      product_ptb<HD>(dk_acc, DSs, Qs);
    }
  }
  // dk += scale * acc, dv += acc (keys below T).
  auto flush = [&](FragC(&acc)[HD / 16], float* out, float mul) {
    __syncthreads();
    stage<HD>(Os, acc);
    __syncthreads();
    for (int i = threadIdx.x; i < kTile * HD; i += kThreads) {
      const int r = i / HD, d = i % HD;
      if (k0 + r < g.T) out[kv_at + int64_t(k0 + r) * KV + d] += mul * Os[r * L::kLdO + d];
    }
  };
  flush(dk_acc, dk, g.scale);
  flush(dv_acc, dv, 1.0f);
}

// --- the register-resident kernels (flash_attention_tiles.hpp) ------------------------------

// flash_attention_tiles.hpp's X on a GPU: the thread itself.
struct Simt {
  __device__ __forceinline__ int thread() const { return threadIdx.x; }
  __device__ __forceinline__ int block(int axis) const {
    return axis == 0 ? blockIdx.x : axis == 1 ? blockIdx.y : blockIdx.z;
  }
  __device__ __forceinline__ unsigned char* shared() const {
    extern __shared__ __align__(128) unsigned char tiles_smem[];
    return tiles_smem;
  }
  __device__ __forceinline__ void sync() const { __syncthreads(); }
  __device__ __forceinline__ float shfl_xor(float v, int mask) const {
    return __shfl_xor_sync(0xffffffffu, v, mask);
  }
  __device__ __forceinline__ void ldmatrix(uint32_t (&r)[4], const uint16_t* row) const {
    const auto at = static_cast<unsigned>(__cvta_generic_to_shared(row));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(at));
  }
  __device__ __forceinline__ void ldmatrix_trans(uint32_t (&r)[4], const uint16_t* row) const {
    const auto at = static_cast<unsigned>(__cvta_generic_to_shared(row));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(at));
  }
  __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                      uint32_t b1) const {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  __device__ __forceinline__ void copy16_async(void* dst, const void* src) const {
    const auto at = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(at),
                 "l"(__cvta_generic_to_global(src))
                 : "memory");
  }
  __device__ __forceinline__ void wait_all() const {
    asm volatile("cp.async.wait_all;\n" ::: "memory");
  }
  __device__ __forceinline__ void zero16(void* dst) const {
    *static_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
  }
  __device__ __forceinline__ float exp2(float v) const {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(v));
    return r;
  }
  __device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) const {
    uint32_t r;  // the first source goes to the upper half
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
};

template <int HD>
__global__ void __launch_bounds__(flash::kThreads)
    tiles_forward_kernel(const uint16_t* q, const uint16_t* k, const uint16_t* v, float* lse,
                         float* attn, flash::Geometry g) {
  Simt x;
  flash::forward_block<HD>(x, q, k, v, lse, attn, g);
}

template <int HD>
__global__ void __launch_bounds__(flash::kThreads)
    tiles_backward_dq_kernel(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                             const float* lse, const uint16_t* dattn, float* drow, float* dq,
                             flash::Geometry g) {
  Simt x;
  flash::backward_dq_block<HD>(x, q, k, v, lse, dattn, drow, dq, g);
}

template <int HD>
__global__ void __launch_bounds__(flash::kThreads)
    tiles_backward_dkv_kernel(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                              const float* lse, const uint16_t* dattn, const float* drow, float* dk,
                              float* dv, flash::Geometry g) {
  Simt x;
  flash::backward_dkv_block<HD>(x, q, k, v, lse, dattn, drow, dk, dv, g);
}

dim3 grid(flash::Grid g) {
  return dim3(static_cast<unsigned>(g.x), static_cast<unsigned>(g.y), static_cast<unsigned>(g.z));
}

template <typename Kernel>
void allow_shared(Kernel kernel, size_t bytes) {
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(bytes)));
}

Geometry geometry(int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd, float scale,
                  const char* what) {
  if (B <= 0 || T <= 0 || nh <= 0 || nkv <= 0 || nh % nkv != 0 || !flash_attention_supported(hd))
    throw InvalidArgument(std::string(what) + ": unsupported shape");
  if (T > (int64_t{1} << 30) || nh > 65535 || B > 65535)
    throw InvalidArgument(std::string(what) + ": sequence, heads or batch too large");
  if (!(scale > 0.0f))  // the kernels take a row's max of scale * s as scale times its max of s
    throw InvalidArgument(std::string(what) + ": scale must be positive");
  return {static_cast<int>(T), static_cast<int>(nh), static_cast<int>(nkv),
          static_cast<int>(nh / nkv), scale};
}

template <int HD>
void forward(const uint16_t* q, const uint16_t* k, const uint16_t* v, int64_t B, Geometry g,
             float* lse, float* attn, cudaStream_t s, FlashKernels kernels) {
  if (kernels == FlashKernels::kMma) {
    allow_shared(tiles_forward_kernel<HD>, flash::Tiles<HD>::kForward);
    tiles_forward_kernel<HD><<<grid(flash::forward_grid(g, static_cast<int>(B))), flash::kThreads,
                               flash::Tiles<HD>::kForward, s>>>(q, k, v, lse, attn, g);
    CUDA_CHECK(cudaGetLastError());
    return;
  }
  allow_shared(flash_forward_kernel<HD>, Layout<HD>::kForward);
  const dim3 blocks(g.nh, (g.T + kTile - 1) / kTile, static_cast<unsigned>(B));
  flash_forward_kernel<HD><<<blocks, kThreads, Layout<HD>::kForward, s>>>(q, k, v, lse, attn, g);
  CUDA_CHECK(cudaGetLastError());
}

template <int HD>
void backward(const uint16_t* q, const uint16_t* k, const uint16_t* v, const float* lse,
              const uint16_t* dattn, int64_t B, Geometry g, float* drow, float* dq, float* dk,
              float* dv, cudaStream_t s, FlashKernels kernels) {
  if (kernels == FlashKernels::kMma) {
    using L = flash::Tiles<HD>;
    allow_shared(tiles_backward_dq_kernel<HD>, L::kDq);
    allow_shared(tiles_backward_dkv_kernel<HD>, L::kDkv);
    tiles_backward_dq_kernel<HD>
        <<<grid(flash::dq_grid(g, static_cast<int>(B))), flash::kThreads, L::kDq, s>>>(
            q, k, v, lse, dattn, drow, dq, g);
    CUDA_CHECK(cudaGetLastError());
    tiles_backward_dkv_kernel<HD>
        <<<grid(flash::dkv_grid(g, static_cast<int>(B))), flash::kThreads, L::kDkv, s>>>(
            q, k, v, lse, dattn, drow, dk, dv, g);
    CUDA_CHECK(cudaGetLastError());
    return;
  }
  allow_shared(flash_backward_dq_kernel<HD>, Layout<HD>::kDq);
  allow_shared(flash_backward_dkv_kernel<HD>, Layout<HD>::kDkv);
  const unsigned tiles = static_cast<unsigned>((g.T + kTile - 1) / kTile);
  flash_backward_dq_kernel<HD>
      <<<dim3(g.nh, tiles, static_cast<unsigned>(B)), kThreads, Layout<HD>::kDq, s>>>(
          q, k, v, lse, dattn, drow, dq, g);
  CUDA_CHECK(cudaGetLastError());
  flash_backward_dkv_kernel<HD>
      <<<dim3(g.nkv, tiles, static_cast<unsigned>(B)), kThreads, Layout<HD>::kDkv, s>>>(
          q, k, v, lse, dattn, drow, dk, dv, g);
  CUDA_CHECK(cudaGetLastError());
}

}  // namespace

bool flash_attention_supported(int64_t hd) { return hd == 16 || hd == 32 || hd == 64 || hd == 128; }

void flash_attention_forward(const uint16_t* q, const uint16_t* k, const uint16_t* v, int64_t B,
                             int64_t T, int64_t nh, int64_t nkv, int64_t hd, float scale,
                             float* lse, float* attn, StreamHandle stream, FlashKernels kernels) {
  const Geometry g = geometry(B, T, nh, nkv, hd, scale, "flash_attention_forward");
  const auto s = static_cast<cudaStream_t>(stream);
  switch (hd) {
    case 16:
      return forward<16>(q, k, v, B, g, lse, attn, s, kernels);
    case 32:
      return forward<32>(q, k, v, B, g, lse, attn, s, kernels);
    case 64:
      return forward<64>(q, k, v, B, g, lse, attn, s, kernels);
    default:
      return forward<128>(q, k, v, B, g, lse, attn, s, kernels);
  }
}

void flash_attention_backward(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                              const float* lse, const uint16_t* dattn, int64_t B, int64_t T,
                              int64_t nh, int64_t nkv, int64_t hd, float scale, float* drow,
                              float* dq, float* dk, float* dv, StreamHandle stream,
                              FlashKernels kernels) {
  const Geometry g = geometry(B, T, nh, nkv, hd, scale, "flash_attention_backward");
  const auto s = static_cast<cudaStream_t>(stream);
  switch (hd) {
    case 16:
      return backward<16>(q, k, v, lse, dattn, B, g, drow, dq, dk, dv, s, kernels);
    case 32:
      return backward<32>(q, k, v, lse, dattn, B, g, drow, dq, dk, dv, s, kernels);
    case 64:
      return backward<64>(q, k, v, lse, dattn, B, g, drow, dq, dk, dv, s, kernels);
    default:
      return backward<128>(q, k, v, lse, dattn, B, g, drow, dq, dk, dv, s, kernels);
  }
}

}  // namespace outcore::device::cuda
