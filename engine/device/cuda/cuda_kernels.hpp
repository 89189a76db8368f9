// CUDA kernels of the model's math and a cuBLASLt GEMM, callable from host code (built only
// where nvcc exists: OUTCORE_HAVE_CUDA). Every pointer is device memory on the current CUDA
// device unless a comment says otherwise; every call is asynchronous on `stream` (a
// cudaStream_t, see Stream::native_handle(); nullptr is the legacy default stream), and throws
// Error naming the failing CUDA call, file and line when a launch fails.
//
// Each kernel's per-element and per-row arithmetic is the one in engine/device/kernel_math.hpp,
// shared with the host kernels of engine/device/cpu; only the reductions differ (block trees here,
// fixed lanes on the host), so results match the host within a few ulp per reduction.
// Reductions are deterministic: the same inputs give the same bits, run after run.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "common/dtype.hpp"
#include "cpu_adam/kernels.hpp"
#include "engine/device/compute_backend.hpp"

namespace outcore::device::cuda {

using StreamHandle = void*;  // a cudaStream_t

// --- element-wise ----------------------------------------------------------------------------

// dst[i] = src[i] as fp32 (src in `dtype` storage) / dst[i] = src[i] rounded to `dtype`.
void to_fp32(const void* src, DType dtype, float* dst, int64_t n, StreamHandle stream);
void from_fp32(const float* src, void* dst, DType dtype, int64_t n, StreamHandle stream);
// y[i] += x[i] (gradient accumulation).
void add_inplace(float* y, const float* x, int64_t n, StreamHandle stream);
// x[r * ld + c] *= scale[r] for r < rows, c < cols.
void scale_rows(float* x, int64_t rows, int64_t cols, int64_t ld, const float* scale,
                StreamHandle stream);
// a = silu(g) * u; backward: dg = da * u * silu'(g), du = da * silu(g) (dg may alias da). With
// the bf16 pointers (the backward's both or neither), the results go there rounded to bf16
// instead (the fp32 ones unused, may be null).
void swiglu_forward(const float* g, const float* u, float* a, int64_t n, StreamHandle stream,
                    uint16_t* a_bf16 = nullptr);
void swiglu_backward(const float* da, const float* g, const float* u, float* dg, float* du,
                     int64_t n, StreamHandle stream, uint16_t* dg_bf16 = nullptr,
                     uint16_t* du_bf16 = nullptr);
// Rotary embedding in place on x = [rows, heads * head_dim], row r at position r % seq;
// cos/sin are [seq, head_dim / 2] (device memory). inverse: the transposed rotation. With
// x_bf16, the result also goes there rounded to bf16 (fp32_to_bf16).
void rope(float* x, int64_t rows, int64_t seq, int64_t heads, int64_t head_dim, const float* cos,
          const float* sin, bool inverse, StreamHandle stream, uint16_t* x_bf16 = nullptr);

// --- embedding -------------------------------------------------------------------------------

// out[i, :] = table[ids[i], :] as fp32 (table [vocab, hidden] in `dtype` storage). ids must lie
// in [0, vocab) (the caller checks them on the host).
void embedding_forward(const void* table, DType dtype, const int32_t* ids, int64_t n,
                       int64_t hidden, float* out, StreamHandle stream);
// grad[ids[i], :] += dy[i, :] for the n tokens grouped in `groups` (TokenGroups::packed() of
// `num_groups` groups, copied to the device): one block per (id, 256 columns), that id's rows
// added in token order, the host's order: bit-identical to it, no atomics.
void embedding_backward(const int32_t* groups, int64_t n, int64_t num_groups, const float* dy,
                        int64_t hidden, float* grad, StreamHandle stream);

// --- RMSNorm ---------------------------------------------------------------------------------

// Over rows of `dim`: rstd[r] = 1/sqrt(mean(x[r]^2) + eps), y = w * x * rstd; with y_bf16,
// y goes there rounded to bf16 instead (y unused, may be null).
void rmsnorm_forward(const float* x, const float* w, float eps, int64_t rows, int64_t dim, float* y,
                     float* rstd, StreamHandle stream, uint16_t* y_bf16 = nullptr);
// dx += dL/dx; dw += dL/dw (blocks of 32 columns over ranges of rows, norm::dw_split; within a
// block the rows split over 32 lanes, the lanes and then the ranges added in order:
// deterministic, within a few ulp of the host's row-ordered sum). `dw_partials`: device memory
// of norm::kDwPartialBytes for the ranges' sums; null runs one range per column tile.
void rmsnorm_backward(const float* dy, const float* x, const float* w, const float* rstd,
                      int64_t rows, int64_t dim, float* dx, float* dw, float* dw_partials,
                      StreamHandle stream);

// --- attention softmax -----------------------------------------------------------------------

// Causal softmax in place on `batch` score matrices of [rows, keys] (row-major, contiguous),
// row i being query first_query + i: keys 0..first_query+i are normalised, the rest set to 0;
// lse[b * lse_stride + i] receives the row's log-sum-exp (lse_stride 0: rows). With `inv_sum`
// (laid out as lse): the numerators of ComputeBackend::causal_softmax_forward instead, and 1 /
// their sum. REQUIRES first_query + rows <= keys.
void causal_softmax_forward(float* scores, float* lse, int64_t batch, int64_t rows, int64_t keys,
                            int64_t first_query, StreamHandle stream, int64_t lse_stride = 0,
                            float* inv_sum = nullptr);
// Given scores (scaled q k^T, as forward saw them) and dp = dL/dprob, both [batch, rows, keys]:
// scores becomes prob = exp(scores - lse) (0 beyond the causal limit) and dp becomes
// dL/dscores = prob * (dp - D), D = delta[b * lse_stride + i] when `delta` is given (laid out as
// lse), else sum(prob * dp).
void causal_softmax_backward(float* scores, float* dp, const float* lse, int64_t batch,
                             int64_t rows, int64_t keys, int64_t first_query, StreamHandle stream,
                             int64_t lse_stride = 0, const float* delta = nullptr);
// ComputeBackend::attention_delta: delta [B, nh, T] = kmath::bf16_row_dot of each head's hd
// values of attn and dattn ([B*T, nh*hd] bf16), a thread per row: the host's bits.
void attention_delta(const uint16_t* attn, const uint16_t* dattn, int64_t B, int64_t T, int64_t nh,
                     int64_t hd, float* delta, StreamHandle stream);

// --- fused causal attention, bf16 operands (flash_attention.cu) ------------------------------

// Whether the fused kernels take this head size (16, 32, 64 or 128) on the current device (its
// shared memory per block: flash::fits_shared).
bool flash_attention_supported(int64_t hd);
// The register-resident tiles of flash_attention_tiles.hpp on mma.sync (decision 031):
// ComputeBackend::attention_forward / attention_backward with dtype BF16 and the same rounding
// points, without score blocks in device memory: q, dattn [B*T, nh*hd], k, v [B*T, nkv*hd]
// (bf16 bits, token-major, 16-byte aligned rows); lse [B, nh, T]. Forward writes lse and attn
// (fp32), or with attn_bf16 that output rounded to bf16 there instead. Backward takes attn,
// forward's output rounded to bf16, writes each row's D = bf16_row_dot(attn, dattn) into delta
// (B*nh*T floats of scratch), then writes dq and adds into dk and dv (fp32). Deterministic:
// each output is written by one block.
// Throws InvalidArgument for a head size not supported, a shape out of range or a scale not
// above 0.
void flash_attention_forward(const uint16_t* q, const uint16_t* k, const uint16_t* v, int64_t B,
                             int64_t T, int64_t nh, int64_t nkv, int64_t hd, float scale,
                             float* lse, float* attn, StreamHandle stream,
                             uint16_t* attn_bf16 = nullptr);
void flash_attention_backward(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                              const float* lse, const uint16_t* attn, const uint16_t* dattn,
                              int64_t B, int64_t T, int64_t nh, int64_t nkv, int64_t hd,
                              float scale, float* delta, float* dq, float* dk, float* dv,
                              StreamHandle stream);

// --- cross-entropy head ----------------------------------------------------------------------

// For each of `rows` rows of logits [rows, vocab]: row_loss[r] = lse - logits[r, targets[r]].
// With `grad`, logits becomes coef * (softmax - onehot(target)) (xent_scale, xent_target), or,
// with `grad_bf16`, that gradient goes there rounded to bf16 (fp32_to_bf16) and logits keeps
// the logits.
void cross_entropy(float* logits, const int32_t* targets, int64_t rows, int64_t vocab, float coef,
                   bool grad, float* row_loss, StreamHandle stream, uint16_t* grad_bf16 = nullptr);

// --- gradient checks -------------------------------------------------------------------------

// Partial sums a deterministic sum of squares uses: `partials` must hold kSumSquaresPartials
// floats. *out = sum(x[i]^2) (device scalar).
inline constexpr int kSumSquaresPartials = 256;
void sum_squares(const float* x, int64_t n, float* partials, float* out, StreamHandle stream);
// *count += the number of inf/NaN elements of x (device scalar).
void count_nonfinite(const float* x, int64_t n, unsigned int* count, StreamHandle stream);
// The gradient norm's block sums, cpu_adam::block_sums_of_squares over fp32 to the bit: out[b]
// (device memory, ceil(n / block) doubles) is the sum of the squares of x[b * block, min(n,
// (b + 1) * block)) in cpu_adam::math's 16 double lanes (square_lane, reduce_square_lanes), one
// half-warp per block. Makes the stream's GPU current on the calling thread first.
void block_sums_of_squares(const float* x, int64_t n, int64_t block, double* out,
                           StreamHandle stream);

// --- optimizer -------------------------------------------------------------------------------

// One Adam step over n elements in place, cpu_adam::adam_step's arithmetic element for element
// (cpu_adam::math::adam_element, the same bits): `coeffs` from cpu_adam::adam_coefficients,
// `pytorch` its formula (Formula::kPyTorch), fp32 `grads`, moments fp32 or bf16
// (`bf16_moments`, widened exactly and rounded to nearest even on store), and `out` (nullable)
// n elements of `out_dtype` (BF16 or F16): the new master weights rounded. Makes the stream's
// GPU current on the calling thread first (any thread may step).
void adam_step(const cpu_adam::detail::AdamCoeffs& coeffs, bool pytorch, int64_t n, float* params,
               const float* grads, void* exp_avg, void* exp_avg_sq, bool bf16_moments, void* out,
               DType out_dtype, StreamHandle stream);

// --- GEMM ------------------------------------------------------------------------------------

// The alignment cuBLASLt is told for an operand at `p` (and, in a batch of more than one, at
// p + i * stride_bytes): the largest power of two dividing every such address, at most 256
// (cuBLASLt's default assumption). Fully aligned operands get the same algorithm as without the
// preference, so their bits do not depend on it.
inline uint32_t gemm_alignment(const void* p, int64_t batch = 1, int64_t stride_bytes = 0) {
  const auto at = reinterpret_cast<uintptr_t>(p);
  const auto stride = static_cast<uint64_t>(batch > 1 ? stride_bytes : 0);
  uint32_t align = 256;
  while (align > 1 && (at % align != 0 || stride % align != 0)) align /= 2;
  return align;
}

// The path cuBLASLt was loaded from, loading it if no Gemm has yet (Gemm loads it on first use;
// a process that makes none never maps it). Throws naming the library when it cannot be loaded.
std::string cublaslt_library();

// Row-major C[m,n] = alpha * op(A) op(B) + beta * C (C fp32, accumulation fp32), op(A) [m,k],
// op(B) [k,n]; A and B share one dtype: F32 (computed in fp32, no TF32), BF16 or F16.
// beta == 0 ignores C's old contents. Batched: `batch` products, operand i at base + i * stride
// (elements). Owns a cuBLASLt handle and a workspace; one Gemm per thread at a time.
class Gemm {
 public:
  // On the current CUDA device, with `workspace_bytes` of cuBLASLt workspace at `workspace`
  // (device memory the caller keeps alive), or allocated and owned here when `workspace` is null.
  explicit Gemm(void* workspace = nullptr, size_t workspace_bytes = size_t{32} << 20);
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  void run(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const void* a,
           int64_t lda, const void* b, int64_t ldb, DType ab_dtype, float beta, float* c,
           int64_t ldc, StreamHandle stream, int64_t batch = 1, int64_t stride_a = 0,
           int64_t stride_b = 0, int64_t stride_c = 0);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace outcore::device::cuda
