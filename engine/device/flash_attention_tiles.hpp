// The fused causal attention's thread blocks, register-resident: bf16 operands, products on
// tensor cores through mma.sync (m16n8k16, fp32 accumulation), scores, probabilities and score
// gradients kept in the accumulators' registers, never in memory. One source for two machines:
// engine/device/cuda/flash_attention.cu runs these bodies as CUDA kernels, and the tests run the
// same bodies on the host under a SIMT emulation of a thread block (tests/common/simt.hpp), so
// every index, mask and rounding point is checked on machines without a GPU.
//
// A body is a template over X, the thread's view of its machine:
//   int thread() const, block(axis) const     threadIdx.x, blockIdx.{x,y,z}
//   unsigned char* shared()                   the block's dynamic shared memory
//   void sync()                               __syncthreads
//   float shfl_xor(float v, int mask)         __shfl_xor_sync over the whole warp
//   void ldmatrix(uint32_t (&r)[4], const uint16_t* row)        ldmatrix .m8n8.x4 .b16
//   void ldmatrix_trans(uint32_t (&r)[4], const uint16_t* row)  the same, .trans
//   void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1)
//                                             d += a b, mma.sync .m16n8k16 .row.col f32.bf16
//   void copy16_async(void* dst, const void* src)   cp.async.cg 16 bytes, global to shared
//   void wait_all()                           cp.async.wait_all: this thread's copies have landed
//   void zero16(void* dst)                    16 zero bytes into shared memory
//   float exp2(float v)                       2^v: ex2.approx.ftz on a GPU, a few units in the
//                                             last place from the host's exp2f
//   uint32_t pack_bf16x2(float lo, float hi)  cvt.rn.bf16x2.f32: both rounded to nearest even
//                                             (kmath::fp32_to_bf16's bits but for NaN payloads)
// The fragment layouts are PTX's: lane l is in group g = l / 4 at position t = l % 4; an
// accumulator d holds rows g and g + 8, columns 2t and 2t + 1 (d[0], d[1] on row g); an A
// operand holds (row g, columns 2t..2t+1), (g + 8, 2t..), (g, 2t + 8..), (g + 8, 2t + 8..) as
// bf16 pairs, the lower column in the lower half; a B operand holds (rows 2t..2t+1, column g)
// and (rows 2t + 8.., column g). ldmatrix x4 loads four 8 x 8 matrices, lane l naming row l % 8
// of matrix l / 8; register i receives matrix i's (row g, columns 2t..2t+1), or with .trans
// its (rows 2t..2t+1, column g).
//
// The rounding points are the default attention's (compute_backend.hpp): the forward rounds
// the numerators exp(s - m) to bf16, m being the row's max rounded up to a multiple of ln 2, and
// divides their product with v by the row's sum (decision 034: one pass over the keys, raising m
// as it goes, each raise a power of two that scales the rounded numerators exactly); the
// backward rounds p = exp(s - lse) and ds = p (dp - D), D being the dot of the row's bf16 output
// and output gradient (ComputeBackend::attention_delta, found before these blocks run, as
// FlashAttention-2 finds it). The exponentials are the hardware's: each is
// 2^(s * scale * log2(e) - m) with the row's m kept in that base-2 domain, one fma and one ex2
// per score (the host's exp polynomial would cost more than the products).
// Only the tiles that the causal diagonal (or the sequence's end) crosses test each element
// against the mask; the others take every element. Tiles come from global memory
// through cp.async, the next one on its way while the current one computes: each load waits
// (wait_all, then a barrier) before its tile is read, and is issued only after a barrier that
// follows the last read of the buffer it fills. Work split, each output written by one block
// (deterministic, no atomics):
//   forward  one block per (head, 128 queries, sequence), a warp per 32 queries (two strips of
//            16 sharing each K and V fragment) whose q rows it holds in registers,
//            kForwardKeys keys per step of its running max;
//   dq       one block per (head, 64 queries, sequence), a warp per 16 queries whose q and
//            dattn rows it holds in registers: dq = scale * ds k;
//   dkv      one block per (kv head, 64 keys, sequence), a warp per 16 keys, over the heads of
//            the group and the 32-query tiles at or after the keys: dk += scale ds^T q,
//            dv += p^T dattn.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "engine/device/kernel_math.hpp"

#if defined(__CUDACC__)
#define OUTCORE_TILE __device__ __forceinline__
#define OUTCORE_UNROLL _Pragma("unroll")
#else
#define OUTCORE_TILE inline
#define OUTCORE_UNROLL
#endif

namespace outcore::flash {

constexpr int kRows = 64;  // queries per dq block, keys per dkv block and per key tile
constexpr int kWarps = 4;  // a warp per 16 of them
constexpr int kThreads = 32 * kWarps;
constexpr int kDkvQueries = 32;                             // queries per step of a dkv block
constexpr int kForwardStrips = 2;                           // 16-row strips per warp in the forward
constexpr int kForwardRows = 16 * kForwardStrips * kWarps;  // queries per forward block
constexpr int kForwardKeys = 16;  // keys per step of the forward's running max
static_assert(kRows == 16 * kWarps, "a warp per 16 rows");
// The longest sequence a launch takes: the grid's y (at most 65535) runs over tiles of kRows.
constexpr int64_t kMaxTokens = int64_t{65535} * kRows;

// Shapes shared by the blocks of one launch.
struct Geometry {
  int T, nh, nkv, group;
  float scale;
};

// A launch's blocks: x over heads (kv heads for dkv), y over row tiles, z over sequences.
// Blocks start in order, x fastest, so every head's costliest tiles come first and the cheapest
// last (a causal forward or dq block's work grows with its queries' position, a dkv block's
// shrinks with its keys'): the wave that ends a launch is the short one.
struct Grid {
  int x, y, z;
};
OUTCORE_HD int row_tiles(const Geometry& g, int rows = kRows) { return (g.T + rows - 1) / rows; }
OUTCORE_HD Grid forward_grid(const Geometry& g, int B) {
  return {g.nh, row_tiles(g, kForwardRows), B};
}
OUTCORE_HD Grid dq_grid(const Geometry& g, int B) { return {g.nh, row_tiles(g), B}; }
OUTCORE_HD Grid dkv_grid(const Geometry& g, int B) { return {g.nkv, row_tiles(g), B}; }
// The first query of a forward (rows kForwardRows) or dq block: the last tile first.
template <class X>
OUTCORE_TILE int first_query(X& x, const Geometry& g, int rows = kRows) {
  return (row_tiles(g, rows) - 1 - x.block(1)) * rows;
}

// Shared memory: bf16 tiles [rows][HD + 8] (rows on 16 bytes, ldmatrix free of bank conflicts).
template <int HD>
struct Tiles {
  static constexpr int kLd = HD + 8;
  static constexpr size_t kTile = size_t(kRows) * kLd * sizeof(uint16_t);
  static constexpr size_t kHalf = size_t(kDkvQueries) * kLd * sizeof(uint16_t);
  // One step of a dkv block: 32 query rows, their dattn rows, lse and D.
  static constexpr size_t kDkvStep = 2 * kHalf + 2 * kDkvQueries * sizeof(float);
  static constexpr size_t kForward =  // Q, two (K, V) pairs
      size_t(kForwardRows) * kLd * sizeof(uint16_t) + 4 * kTile;
  static constexpr size_t kDq = 6 * kTile;                  // Q, dO, two (K, V) pairs
  static constexpr size_t kDkv = 2 * kTile + 2 * kDkvStep;  // K, V, two steps
  static constexpr size_t kMost = kForward > kDq ? (kForward > kDkv ? kForward : kDkv)
                                                 : (kDq > kDkv ? kDq : kDkv);
};

// The most dynamic shared memory a block of head size `hd` takes (0 for a head size the
// kernels do not take), and whether a device allowing `optin` bytes per block (its opt-in
// limit: 227 KiB on sm_90, 163 KiB on sm_80, 99 KiB on sm_86 / sm_89 / sm_120) runs them all.
constexpr size_t shared_bytes(int64_t hd) {
  return hd == 16    ? Tiles<16>::kMost
         : hd == 32  ? Tiles<32>::kMost
         : hd == 64  ? Tiles<64>::kMost
         : hd == 128 ? Tiles<128>::kMost
                     : 0;
}
constexpr bool fits_shared(int64_t hd, size_t optin) {
  return shared_bytes(hd) != 0 && shared_bytes(hd) <= optin;
}

// Starts loading rows [row0, row0 + n) of a token-major bf16 matrix (row r at src + r * ld, HD
// contiguous elements) into tile rows [0, n); rows at or beyond `rows` become zeros. The tile is
// readable after wait_all and a barrier.
template <int HD, class X>
OUTCORE_TILE void load_rows(X& x, uint16_t* tile, const uint16_t* src, int64_t ld, int row0, int n,
                            int rows) {
  constexpr int kVecs = HD / 8;  // 8 bf16 per 16 bytes
  for (int i = x.thread(); i < n * kVecs; i += kThreads) {
    const int r = i / kVecs, c = i % kVecs;
    uint16_t* dst = tile + r * Tiles<HD>::kLd + c * 8;
    if (row0 + r < rows)
      x.copy16_async(dst, src + (row0 + r) * ld + c * 8);
    else
      x.zero16(dst);
  }
}

// The loads issued so far have landed and every thread is past the reads before this point.
template <class X>
OUTCORE_TILE void landed(X& x) {
  x.wait_all();
  x.sync();
}

// The lane's row within a 16-row strip for ldmatrix: matrices 0..3 at (rows +0, cols +0),
// (+8, +0), (+0, +8), (+8, +8) for an A operand or a transposed B; (+0, +0), (+0, +8),
// (+8, +0), (+8, +8) for a B taken from a row-major [n][k] tile.
OUTCORE_TILE int a_row(int lane) { return (lane % 8) + 8 * ((lane / 8) % 2); }
OUTCORE_TILE int a_col(int lane) { return 8 * (lane / 16); }
OUTCORE_TILE int b_row(int lane) { return (lane % 8) + 8 * (lane / 16); }
OUTCORE_TILE int b_col(int lane) { return 8 * ((lane / 8) % 2); }

// acc[N][4] += A[16 x HD] B[N*8 x HD]^T: A rows a_tile[0..16), B rows b_tile[0..N*8) (both
// [.][HD + 8] bf16 in shared memory), A's fragments read from shared memory at each step.
template <int HD, int N, class X>
OUTCORE_TILE void product_abt(X& x, float (&acc)[N][4], const uint16_t* a_tile,
                              const uint16_t* b_tile, int lane) {
  constexpr int ld = Tiles<HD>::kLd;
  static_assert(N % 2 == 0, "n tiles in pairs");
  OUTCORE_UNROLL
  for (int kk = 0; kk < HD; kk += 16) {
    uint32_t a[4];
    x.ldmatrix(a, a_tile + a_row(lane) * ld + kk + a_col(lane));
    OUTCORE_UNROLL
    for (int n = 0; n < N; n += 2) {
      uint32_t b[4];
      x.ldmatrix(b, b_tile + (8 * n + b_row(lane)) * ld + kk + b_col(lane));
      x.mma(acc[n], a, b[0], b[1]);
      x.mma(acc[n + 1], a, b[2], b[3]);
    }
  }
}

// A 16-row strip of a_tile ([.][HD + 8] bf16 in shared memory) as the A operands of products
// over HD, held in registers: a[c] for the columns 16 c .. 16 c + 16.
template <int HD, class X>
OUTCORE_TILE void load_strip(X& x, uint32_t (&a)[HD / 16][4], const uint16_t* a_tile, int lane) {
  OUTCORE_UNROLL
  for (int kk = 0; kk < HD; kk += 16)
    x.ldmatrix(a[kk / 16], a_tile + a_row(lane) * Tiles<HD>::kLd + kk + a_col(lane));
}

// acc[R][N][4] += A[16 R x HD] B[N*8 x HD]^T, strip r of A held in registers (load_strip) as
// a[r], B rows b_tile[0..N*8). Each B fragment serves the R strips.
template <int HD, int R, int N, class X>
OUTCORE_TILE void product_held_abt(X& x, float (&acc)[R][N][4], const uint32_t (&a)[R][HD / 16][4],
                                   const uint16_t* b_tile, int lane) {
  constexpr int ld = Tiles<HD>::kLd;
  static_assert(N % 2 == 0, "n tiles in pairs");
  OUTCORE_UNROLL
  for (int kk = 0; kk < HD; kk += 16) OUTCORE_UNROLL
  for (int n = 0; n < N; n += 2) {
    uint32_t b[4];
    x.ldmatrix(b, b_tile + (8 * n + b_row(lane)) * ld + kk + b_col(lane));
    OUTCORE_UNROLL
    for (int r = 0; r < R; ++r) {
      x.mma(acc[r][n], a[r][kk / 16], b[0], b[1]);
      x.mma(acc[r][n + 1], a[r][kk / 16], b[2], b[3]);
    }
  }
}
template <int HD, int N, class X>
OUTCORE_TILE void product_held_abt(X& x, float (&acc)[N][4], const uint32_t (&a)[HD / 16][4],
                                   const uint16_t* b_tile, int lane) {
  product_held_abt<HD>(x, reinterpret_cast<float(&)[1][N][4]>(acc),
                       reinterpret_cast<const uint32_t(&)[1][HD / 16][4]>(a), b_tile, lane);
}

// acc[R][HD / 8][4] += P[16 R x 16 K] B[16 K x HD]: strip r of P as A operands p[r][K][4]
// (already in registers), B rows b_tile[0..16 K) ([.][HD + 8] bf16 in shared memory).
template <int HD, int R, int K, class X>
OUTCORE_TILE void product_pb(X& x, float (&acc)[R][HD / 8][4], const uint32_t (&p)[R][K][4],
                             const uint16_t* b_tile, int lane) {
  constexpr int ld = Tiles<HD>::kLd;
  OUTCORE_UNROLL
  for (int kc = 0; kc < K; ++kc) OUTCORE_UNROLL
  for (int n = 0; n < HD / 8; n += 2) {
    uint32_t b[4];
    x.ldmatrix_trans(b, b_tile + (16 * kc + a_row(lane)) * ld + 8 * n + a_col(lane));
    OUTCORE_UNROLL
    for (int r = 0; r < R; ++r) {
      x.mma(acc[r][n], p[r][kc], b[0], b[1]);
      x.mma(acc[r][n + 1], p[r][kc], b[2], b[3]);
    }
  }
}
template <int HD, int K, class X>
OUTCORE_TILE void product_pb(X& x, float (&acc)[HD / 8][4], const uint32_t (&p)[K][4],
                             const uint16_t* b_tile, int lane) {
  product_pb<HD>(x, reinterpret_cast<float(&)[1][HD / 8][4]>(acc),
                 reinterpret_cast<const uint32_t(&)[1][K][4]>(p), b_tile, lane);
}

// Accumulators of N = 2K tiles of 8 columns (one 16-row strip) as the A operands of K products
// of 16 columns, each value first through f(value, tile, element).
template <int K, class X, class F>
OUTCORE_TILE void to_operands(X& x, uint32_t (&a)[K][4], const float (&c)[2 * K][4], F f) {
  OUTCORE_UNROLL
  for (int k = 0; k < K; ++k) {
    a[k][0] = x.pack_bf16x2(f(c[2 * k][0], 2 * k, 0), f(c[2 * k][1], 2 * k, 1));
    a[k][1] = x.pack_bf16x2(f(c[2 * k][2], 2 * k, 2), f(c[2 * k][3], 2 * k, 3));
    a[k][2] = x.pack_bf16x2(f(c[2 * k + 1][0], 2 * k + 1, 0), f(c[2 * k + 1][1], 2 * k + 1, 1));
    a[k][3] = x.pack_bf16x2(f(c[2 * k + 1][2], 2 * k + 1, 2), f(c[2 * k + 1][3], 2 * k + 1, 3));
  }
}

// Scores to the base-2 domain of X::exp2: exp(scale s - m) = 2^(s (scale log2 e) - m log2 e).
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2 = 0.693147180559945309f;

// f(Full<true>{}) for a tile whose every element is inside the mask, f(Full<false>{}) for one
// that the diagonal or the sequence's end crosses: `full || valid(...)` then folds to no test at
// all on the first.
template <bool B>
struct Full {
  OUTCORE_TILE constexpr operator bool() const { return B; }
};
template <class F>
OUTCORE_TILE void masked_or_full(bool full, F f) {
  if (full)
    f(Full<true>{});
  else
    f(Full<false>{});
}

template <int N>
OUTCORE_TILE void zero(float (&acc)[N][4]) {
  OUTCORE_UNROLL
  for (auto& f : acc) f[0] = f[1] = f[2] = f[3] = 0.0f;
}

// The number of key tiles at or below the last query of the tile starting at q0.
OUTCORE_TILE int last_tile(int q0, int T) {
  return ((q0 + kRows < T ? q0 + kRows : T) - 1) / kRows + 1;
}

// The max (or sum) over the four lanes that share a row.
template <class X>
OUTCORE_TILE float row_max(X& x, float v) {
  v = fmaxf(v, x.shfl_xor(v, 1));
  return fmaxf(v, x.shfl_xor(v, 2));
}
template <class X>
OUTCORE_TILE float row_sum(X& x, float v) {
  v += x.shfl_xor(v, 1);
  return v + x.shfl_xor(v, 2);
}

// --- forward: lse [B, nh, T], attn [B*T, nh*HD] fp32, or attn16 in bf16 (when not null) -----

template <int HD, class X>
OUTCORE_TILE void forward_block(X& x, const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                float* lse, float* attn, uint16_t* attn16, const Geometry& g) {
  using L = Tiles<HD>;
  constexpr int R = kForwardStrips, C = kForwardKeys, N = C / 8;
  static_assert(kRows % C == 0 && C % 16 == 0, "whole 16-key products in a key tile");
  uint16_t* Qs = reinterpret_cast<uint16_t*>(x.shared());
  // Key tile i in (K, V) pair i % 2, loaded while tile i - 1 computes.
  const auto Kbuf = [&](int i) { return Qs + (kForwardRows + 2 * (i % 2) * kRows) * L::kLd; };
  const auto Vbuf = [&](int i) { return Kbuf(i) + kRows * L::kLd; };
  const int q0 = first_query(x, g, kForwardRows), h = x.block(0), b = x.block(2);
  const int w = x.thread() / 32, lane = x.thread() % 32, gr = lane / 4, tc = lane % 4;
  const int64_t Q = int64_t(g.nh) * HD, KV = int64_t(g.nkv) * HD;
  const uint16_t* qb = q + int64_t(b) * g.T * Q + int64_t(h) * HD;
  const uint16_t* kb = k + int64_t(b) * g.T * KV + int64_t(h / g.group) * HD;
  const uint16_t* vb = v + int64_t(b) * g.T * KV + int64_t(h / g.group) * HD;
  const int last = (q0 + kForwardRows < g.T ? q0 + kForwardRows : g.T) - 1;
  const int tiles = last / kRows + 1;  // key tiles at or below the block's last query
  const int w0 = q0 + 16 * R * w;      // the warp's first query; its key tiles:
  const int warp_tiles = w0 < g.T ? ((w0 + 16 * R < g.T ? w0 + 16 * R : g.T) - 1) / kRows + 1 : 0;
  // The lane's queries: rows g and g + 8 of each strip (element e of an accumulator: row e / 2).
  int t[R][2];
  OUTCORE_UNROLL
  for (int r = 0; r < R; ++r) t[r][0] = w0 + 16 * r + gr, t[r][1] = w0 + 16 * r + gr + 8;
  const auto valid = [&](int r, int half, int key) {
    return t[r][half] < g.T && key <= t[r][half];
  };
  const uint16_t* Qw = Qs + 16 * R * w * L::kLd;
  const float sl2 = g.scale * kLog2e;

  const auto load_step = [&](int i) {
    if (i >= tiles) return;
    load_rows<HD>(x, Kbuf(i), kb, KV, i * kRows, kRows, g.T);
    load_rows<HD>(x, Vbuf(i), vb, KV, i * kRows, kRows, g.T);
  };
  load_rows<HD>(x, Qs, qb, Q, q0, kForwardRows, g.T);
  load_step(0);
  // One pass over the keys, C at a time (decision 034): m, each row's shift in the base-2
  // domain, is its max so far of s * sl2 rounded up to a whole number; the numerators
  // 2^(s sl2 - m) are rounded to bf16 and multiplied by v into o, their fp32 sum into the lane's
  // share of the row's l. When m grows, o and l are scaled by 2^(old m - new m), a power of two,
  // exactly: in the end o holds the numerators rounded as if m had been the row's last shift from
  // the start, which is what the host computes. Rows beyond T see no valid key (m stays -inf, o
  // and l 0); a warp skips the tiles wholly after its queries; a tile wholly at or below its
  // first query needs no mask (scale > 0, so the max of s * sl2 is sl2 times the max of s).
  float m[R][2], l[R][2], o[R][HD / 8][4];
  OUTCORE_UNROLL
  for (int r = 0; r < R; ++r) {
    m[r][0] = m[r][1] = -INFINITY, l[r][0] = l[r][1] = 0.0f;
    zero(o[r]);
  }
  uint32_t qa[R][HD / 16][4];  // the warp's q rows, read from shared memory once
  for (int kt = 0; kt < tiles; ++kt) {
    landed(x);
    load_step(kt + 1);
    if (kt == 0) {
      OUTCORE_UNROLL
      for (int r = 0; r < R; ++r) load_strip<HD>(x, qa[r], Qw + 16 * r * L::kLd, lane);
    }
    if (kt >= warp_tiles) continue;
    masked_or_full(kt * kRows + kRows - 1 <= w0, [&](auto full) {
      OUTCORE_UNROLL
      for (int kc = 0; kc < kRows / C; ++kc) {
        const int key0 = kt * kRows + C * kc + 2 * tc;  // the lane's first key of the chunk
        float s[R][N][4];
        OUTCORE_UNROLL
        for (int r = 0; r < R; ++r) zero(s[r]);
        product_held_abt<HD>(x, s, qa, Kbuf(kt) + C * kc * L::kLd, lane);
        OUTCORE_UNROLL
        for (int r = 0; r < R; ++r) OUTCORE_UNROLL
        for (int half = 0; half < 2; ++half) {
          float chunk_max = -INFINITY;
          OUTCORE_UNROLL
          for (int n = 0; n < N; ++n) OUTCORE_UNROLL
          for (int e = 0; e < 2; ++e)
            if (full || valid(r, half, key0 + 8 * n + e))
              chunk_max = fmaxf(chunk_max, s[r][n][2 * half + e]);
          const float m_new =
              fmaxf(m[r][half], kmath::bf16_softmax_shift2(row_max(x, chunk_max) * sl2));
          if (m_new != m[r][half]) {
            const float f = kmath::pow2_whole(m[r][half] - m_new);
            l[r][half] *= f;
            OUTCORE_UNROLL
            for (int n = 0; n < HD / 8; ++n) o[r][n][2 * half] *= f, o[r][n][2 * half + 1] *= f;
            m[r][half] = m_new;
          }
        }
        uint32_t p[R][N / 2][4];
        OUTCORE_UNROLL
        for (int r = 0; r < R; ++r)
          to_operands(x, p[r], s[r], [&](float sv, int n, int e) {
            const int half = e / 2;
            const float num = full || valid(r, half, key0 + 8 * n + e % 2)
                                  ? x.exp2(fmaf(sv, sl2, -m[r][half]))
                                  : 0.0f;
            l[r][half] += num;
            return num;
          });
        product_pb<HD>(x, o, p, Vbuf(kt) + C * kc * L::kLd, lane);
      }
    });
  }
  // The row's sum over its four lanes; lse = (m + log2 l) ln 2; the output o / l, as two floats
  // or one bf16 pair of adjacent columns per lane and row.
  OUTCORE_UNROLL
  for (int r = 0; r < R; ++r) OUTCORE_UNROLL
  for (int half = 0; half < 2; ++half) {
    const float sum = row_sum(x, l[r][half]);
    const int row = t[r][half];
    if (row < g.T && tc == 0)
      lse[(int64_t(b) * g.nh + h) * g.T + row] = (m[r][half] + log2f(sum)) * kLn2;
    const float inv = 1.0f / sum;
    OUTCORE_UNROLL
    for (int n = 0; n < HD / 8; ++n) {
      if (row >= g.T) continue;
      const int64_t at = (int64_t(b) * g.T + row) * Q + int64_t(h) * HD + 8 * n + 2 * tc;
      const float lo = o[r][n][2 * half] * inv, hi = o[r][n][2 * half + 1] * inv;
      if (attn16 != nullptr) {
        const uint32_t pair = x.pack_bf16x2(lo, hi);
        attn16[at] = static_cast<uint16_t>(pair & 0xffffu);
        attn16[at + 1] = static_cast<uint16_t>(pair >> 16);
      } else {
        attn[at] = lo;
        attn[at + 1] = hi;
      }
    }
  }
}

// --- backward: dq [B*T, nh*HD] fp32, given D [B, nh, T] --------------------------------------

template <int HD, class X>
OUTCORE_TILE void backward_dq_block(X& x, const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                    const float* lse, const uint16_t* dattn, const float* delta,
                                    float* dq, const Geometry& g) {
  using L = Tiles<HD>;
  uint16_t* Qs = reinterpret_cast<uint16_t*>(x.shared());
  uint16_t* Ds = Qs + kRows * L::kLd;  // dattn rows
  // (K, V) pairs: pair i % 2 for key tile i.
  const auto Ks = [&](int i) { return Ds + (1 + 2 * (i % 2)) * kRows * L::kLd; };
  const auto Vs = [&](int i) { return Ds + (2 + 2 * (i % 2)) * kRows * L::kLd; };
  const int q0 = first_query(x, g), h = x.block(0), b = x.block(2);
  const int w = x.thread() / 32, lane = x.thread() % 32, gr = lane / 4, tc = lane % 4;
  const int64_t Q = int64_t(g.nh) * HD, KV = int64_t(g.nkv) * HD;
  const int64_t q_at = int64_t(b) * g.T * Q + int64_t(h) * HD;
  const uint16_t* kb = k + int64_t(b) * g.T * KV + int64_t(h / g.group) * HD;
  const uint16_t* vb = v + int64_t(b) * g.T * KV + int64_t(h / g.group) * HD;
  const int tiles = last_tile(q0, g.T);
  const int t[2] = {q0 + 16 * w + gr, q0 + 16 * w + gr + 8};
  const int64_t rows_at = (int64_t(b) * g.nh + h) * g.T;
  const float sl2 = g.scale * kLog2e;
  float l[2], dot[2];  // lse * log2 e (p = 2^(s sl2 - l)) and D of the lane's two rows
  OUTCORE_UNROLL
  for (int r = 0; r < 2; ++r) {
    l[r] = t[r] < g.T ? lse[rows_at + t[r]] * kLog2e : 0.0f;
    dot[r] = t[r] < g.T ? delta[rows_at + t[r]] : 0.0f;
  }
  auto valid = [&](int kt, int n, int e) {
    const int r = e / 2;
    return t[r] < g.T && kt * kRows + 8 * n + 2 * tc + e % 2 <= t[r];
  };
  const auto load_pair = [&](int kt) {
    if (kt >= tiles) return;
    load_rows<HD>(x, Ks(kt), kb, KV, kt * kRows, kRows, g.T);
    load_rows<HD>(x, Vs(kt), vb, KV, kt * kRows, kRows, g.T);
  };

  load_rows<HD>(x, Qs, q + q_at, Q, q0, kRows, g.T);
  load_rows<HD>(x, Ds, dattn + q_at, Q, q0, kRows, g.T);
  load_pair(0);
  // Key tile kt wholly at or below the warp's first query: no mask.
  const auto full_tile = [&](int kt) { return kt * kRows + kRows - 1 <= q0 + 16 * w; };
  // Per key tile: the scores (q k^T) and probability gradients (dattn v^T), ds = p (dp - D)
  // rounded to bf16, dq += ds k. The warp's q and dattn rows are read from shared memory once,
  // into registers, for every tile.
  float acc[HD / 8][4];
  zero(acc);
  uint32_t qa[HD / 16][4], da[HD / 16][4];
  for (int kt = 0; kt < tiles; ++kt) {
    landed(x);
    load_pair(kt + 1);
    if (kt == 0) {
      load_strip<HD>(x, qa, Qs + 16 * w * L::kLd, lane);
      load_strip<HD>(x, da, Ds + 16 * w * L::kLd, lane);
    }
    float s[8][4], dp[8][4];
    zero(s);
    zero(dp);
    product_held_abt<HD>(x, s, qa, Ks(kt), lane);
    product_held_abt<HD>(x, dp, da, Vs(kt), lane);
    // ds in place of s (to_operands reads each element once, with its dp beside it).
    masked_or_full(full_tile(kt), [&](auto full) {
      OUTCORE_UNROLL
      for (int n = 0; n < 8; ++n) OUTCORE_UNROLL
      for (int e = 0; e < 4; ++e)
        s[n][e] =
            full || valid(kt, n, e)
                ? kmath::softmax_grad(x.exp2(fmaf(s[n][e], sl2, -l[e / 2])), dp[n][e], dot[e / 2])
                : 0.0f;
    });
    uint32_t ds[4][4];
    to_operands(x, ds, s, [](float sv, int, int) { return sv; });
    product_pb<HD>(x, acc, ds, Ks(kt), lane);
  }
  OUTCORE_UNROLL
  for (int n = 0; n < HD / 8; ++n) OUTCORE_UNROLL
  for (int e = 0; e < 4; ++e) {
    const int r = e / 2;
    if (t[r] < g.T) dq[q_at + int64_t(t[r]) * Q + 8 * n + 2 * tc + e % 2] = g.scale * acc[n][e];
  }
}

// --- backward: dk, dv [B*T, nkv*HD] fp32, added into ------------------------------------------

template <int HD, class X>
OUTCORE_TILE void backward_dkv_block(X& x, const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                     const float* lse, const uint16_t* dattn, const float* delta,
                                     float* dk, float* dv, const Geometry& g) {
  using L = Tiles<HD>;
  constexpr int kN = kDkvQueries / 8;  // accumulator tiles across a step's queries
  uint16_t* Ks = reinterpret_cast<uint16_t*>(x.shared());
  uint16_t* Vs = Ks + kRows * L::kLd;
  unsigned char* steps_at = reinterpret_cast<unsigned char*>(Vs + kRows * L::kLd);
  // Step i's query rows, dattn rows, lse and D, in buffer i % 2.
  struct Step {
    uint16_t *Qs, *Ds;
    float *lse_s, *d_s;
  };
  const auto step_buffers = [&](int i) {
    unsigned char* at = steps_at + (i % 2) * L::kDkvStep;
    uint16_t* Qs = reinterpret_cast<uint16_t*>(at);
    uint16_t* Ds = Qs + kDkvQueries * L::kLd;
    float* lse_s = reinterpret_cast<float*>(Ds + kDkvQueries * L::kLd);
    return Step{Qs, Ds, lse_s, lse_s + kDkvQueries};
  };
  const int k0 = x.block(1) * kRows, gkv = x.block(0), b = x.block(2);
  const int w = x.thread() / 32, lane = x.thread() % 32, gr = lane / 4, tc = lane % 4;
  const int64_t Q = int64_t(g.nh) * HD, KV = int64_t(g.nkv) * HD;
  const int64_t kv_at = int64_t(b) * g.T * KV + int64_t(gkv) * HD;
  // Steps: the heads of the group, each over the 32-query tiles at or after the block's keys.
  const int first_tile = k0 / kDkvQueries;
  const int per_head = (g.T + kDkvQueries - 1) / kDkvQueries - first_tile;
  const int steps = g.group * per_head;
  const auto load_step = [&](int i) {
    if (i >= steps) return;
    const Step st = step_buffers(i);
    const int h = gkv * g.group + i / per_head, q0 = (first_tile + i % per_head) * kDkvQueries;
    const int64_t q_at = int64_t(b) * g.T * Q + int64_t(h) * HD;
    const int64_t rows_at = (int64_t(b) * g.nh + h) * g.T;
    load_rows<HD>(x, st.Qs, q + q_at, Q, q0, kDkvQueries, g.T);
    load_rows<HD>(x, st.Ds, dattn + q_at, Q, q0, kDkvQueries, g.T);
    for (int r = x.thread(); r < kDkvQueries; r += kThreads) {
      st.lse_s[r] = q0 + r < g.T ? lse[rows_at + q0 + r] * kLog2e : 0.0f;
      st.d_s[r] = q0 + r < g.T ? delta[rows_at + q0 + r] : 0.0f;
    }
  };
  const int key[2] = {k0 + 16 * w + gr, k0 + 16 * w + gr + 8};  // the lane's two keys
  const float sl2 = g.scale * kLog2e;

  load_rows<HD>(x, Ks, k + kv_at, KV, k0, kRows, g.T);
  load_rows<HD>(x, Vs, v + kv_at, KV, k0, kRows, g.T);
  load_step(0);
  float dk_acc[HD / 8][4], dv_acc[HD / 8][4];
  zero(dk_acc);
  zero(dv_acc);
  for (int i = 0; i < steps; ++i) {
    landed(x);
    load_step(i + 1);
    const Step st = step_buffers(i);
    const int q0 = (first_tile + i % per_head) * kDkvQueries;
    // Transposed: rows are the warp's keys, columns the step's queries.
    float s[kN][4], dp[kN][4];
    zero(s);
    zero(dp);
    product_abt<HD>(x, s, Ks + 16 * w * L::kLd, st.Qs, lane);
    product_abt<HD>(x, dp, Vs + 16 * w * L::kLd, st.Ds, lane);
    // p = 2^(s sl2 - lse log2 e); no mask where the step's queries are all below T and at or
    // after the warp's last key.
    float pf[kN][4];
    masked_or_full(k0 + 16 * w + 15 <= q0 && q0 + kDkvQueries <= g.T, [&](auto full) {
      OUTCORE_UNROLL
      for (int n = 0; n < kN; ++n) OUTCORE_UNROLL
      for (int e = 0; e < 4; ++e) {
        const int c = 8 * n + 2 * tc + e % 2;  // query q0 + c
        const bool valid = full || (q0 + c < g.T && key[e / 2] <= q0 + c);
        pf[n][e] = valid ? x.exp2(fmaf(s[n][e], sl2, -st.lse_s[c])) : 0.0f;
        dp[n][e] = valid ? kmath::softmax_grad(pf[n][e], dp[n][e], st.d_s[c]) : 0.0f;
      }
    });
    uint32_t p[kN / 2][4], ds[kN / 2][4];
    to_operands(x, p, pf, [](float sv, int, int) { return sv; });
    to_operands(x, ds, dp, [](float sv, int, int) { return sv; });
    product_pb<HD>(x, dv_acc, p, st.Ds, lane);
    product_pb<HD>(x, dk_acc, ds, st.Qs, lane);
  }
  OUTCORE_UNROLL
  for (int n = 0; n < HD / 8; ++n) OUTCORE_UNROLL
  for (int e = 0; e < 4; ++e) {
    const int r = e / 2;
    if (key[r] < g.T) {
      const int64_t at = kv_at + int64_t(key[r]) * KV + 8 * n + 2 * tc + e % 2;
      dk[at] += g.scale * dk_acc[n][e];
      dv[at] += dv_acc[n][e];
    }
  }
}

}  // namespace outcore::flash
