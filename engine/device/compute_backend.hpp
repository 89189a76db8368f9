// ComputeBackend: the math a model runs on a device, behind one small interface (in the spirit
// of ggml-backend). The model (engine/model) writes each unit's forward and backward once, as
// a sequence of these operations on buffers of its device; the backend of that device runs
// them. One folder per backend:
//
//   CPU backend   (cpu_backend(), make_cpu_backend(), engine/device/cpu/cpu_backend.cpp): the
//                 host kernels of engine/device/cpu/kernels.hpp and OpenBLAS sgemm, on
//                 host-dereferenceable memory. On host memory every operation has finished when
//                 it returns; on a discrete CpuDevice (through its host view) the operations are
//                 queued on a compute stream of the device and run in order on its thread, as a
//                 GPU's would, and finish() waits for them.
//   CUDA backend  (make_cuda_backend, engine/device/cuda/cuda_backend.cu, built where nvcc
//                 exists): the kernels of engine/device/cuda/cuda_kernels.hpp and cuBLASLt,
//                 queued on one compute stream of a CudaDevice. Operations return once
//                 launched; finish() waits for them.
//
// Both compute the same per-element arithmetic (engine/device/kernel_math.hpp); only the
// reductions differ (fixed lanes on the host, block trees on the GPU), so the two agree within
// a few ulp per reduction, and each is deterministic run after run.
//
// Pointers: every float / int32 / slab pointer an operation takes is memory the backend's
// device computes on (device memory), except the `host` sides of upload() and download().
// Row-major layouts throughout; shapes as in engine/device/cpu/kernels.hpp.
//
// Threading: a backend is used by one thread at a time (the model's calls are serialized).
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "common/dtype.hpp"
#include "engine/device/device.hpp"

namespace outcore::device {

class Device;
struct WorkspaceShape;

class ComputeBackend {
 public:
  virtual ~ComputeBackend() = default;
  ComputeBackend() = default;
  ComputeBackend(const ComputeBackend&) = delete;
  ComputeBackend& operator=(const ComputeBackend&) = delete;

  // "cpu" or "cuda:0 (...)".
  virtual std::string name() const = 0;

  // ---- memory
  // Device to device, host to device, device to host. download() returns once the bytes are
  // in `host` (after everything queued before it); upload() may return before the copy ends
  // but does not read `host` after returning.
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  virtual void zero(void* dst, size_t bytes) = 0;
  virtual void upload(void* dst, const void* host, size_t bytes) = 0;
  virtual void download(void* host, const void* src, size_t bytes) = 0;
  // Device memory holding `host` (uploaded now), kept until the backend is destroyed: the
  // model's constant tables (rotary cos/sin). On the CPU backend, `host` itself.
  virtual const float* constant(std::span<const float> host) = 0;
  // Device memory holding the `n` ids at `host`, valid until the next call with the same
  // `slot` (0 or 1) or finish(): token and target ids of a micro-batch. On the CPU backend,
  // `host` itself.
  virtual const int32_t* stage_ids(const int32_t* host, int64_t n, int slot) = 0;
  // Blocks until every queued operation has finished; rethrows a failure. The model calls it
  // at the end of each unit's forward and backward unless the caller orders what reads the
  // outputs itself (ForwardArgs::queued: events on stream()).
  virtual void finish() = 0;
  // The device stream the operations are queued on, in order (record an event there to know
  // when what was queued so far has run); nullptr when every operation has finished when it
  // returns.
  virtual Stream* stream() { return nullptr; }
  // Bytes of the device's budget this backend holds now (workspaces, staged ids, constant
  // tables; charged_bytes each). 0 on the CPU backends, which hold none.
  virtual uint64_t device_bytes() const { return 0; }
  // The most it will hold computing a model of `shape` (LlamaModel::workspace_shape): what the
  // planner reserves for it (CUDA: backend_workspace(DeviceKind::Cuda, shape).total()).
  virtual uint64_t workspace_bytes(const WorkspaceShape& /*shape*/) const { return 0; }
  // The device whose budget device_bytes() are charged to (nullptr: none).
  virtual const Device* device() const { return nullptr; }

  // ---- math (fp32 activations; parameters in fp32, bf16 or fp16 storage)
  // C[m,n] = alpha * op(A) op(B) + beta * C, all fp32 (no TF32); beta == 0 ignores C.
  virtual void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                    const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
                    int64_t ldc) = 0;
  // The same with A and B in bf16 storage: every product of two bf16 values is exact in fp32 and
  // accumulated in fp32 (tensor cores on a GPU), C fp32. The bf16 compute dtype's GEMM.
  virtual void gemm_bf16(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                         const void* a, int64_t lda, const void* b, int64_t ldb, float beta,
                         float* c, int64_t ldc) = 0;
  // dst[i] = src[i] as fp32 (src in `dtype` storage).
  virtual void to_fp32(const void* src, DType dtype, float* dst, int64_t n) = 0;
  // dst[i] = src[i] rounded to `dtype` storage (nearest even, kernel_math's rounding; NaN stays
  // NaN): where the bf16 compute dtype rounds a GEMM operand.
  virtual void from_fp32(const float* src, void* dst, DType dtype, int64_t n) = 0;
  virtual void add_inplace(float* y, const float* x, int64_t n) = 0;
  // x[r * ld + c] *= scale[r] for r < rows, c < cols.
  virtual void scale_rows(float* x, int64_t rows, int64_t cols, int64_t ld, const float* scale) = 0;
  // y_bf16 (the bf16 compute dtype's operand): y is written there rounded to bf16 instead, as
  // from_fp32 would round it (y unused, may be null); likewise a_bf16, dg_bf16 and du_bf16 below
  // (both of the last or neither).
  virtual void rmsnorm_forward(const float* x, const float* w, float eps, int64_t rows, int64_t dim,
                               float* y, float* rstd, void* y_bf16) = 0;
  // dx += dL/dx, dw += dL/dw (rows summed in order).
  virtual void rmsnorm_backward(const float* dy, const float* x, const float* w, const float* rstd,
                                int64_t rows, int64_t dim, float* dx, float* dw) = 0;
  // x_bf16 (may be null): the rotated x also written there rounded to bf16 (x keeps it in fp32).
  virtual void rope(float* x, int64_t rows, int64_t seq, int64_t heads, int64_t head_dim,
                    const float* cos, const float* sin, bool inverse, void* x_bf16) = 0;
  virtual void swiglu_forward(const float* g, const float* u, float* a, int64_t n,
                              void* a_bf16) = 0;
  // dg may alias da.
  virtual void swiglu_backward(const float* da, const float* g, const float* u, float* dg,
                               float* du, int64_t n, void* dg_bf16, void* du_bf16) = 0;
  // One [rows, keys] score matrix, row i being query first_query + i: keys 0..first_query+i
  // softmax-normalised in place, the rest set to 0; lse[i] = the row's log-sum-exp. With
  // `inv_sum` (bf16 attention, decision 034) those keys get the softmax's numerators
  // exp(x - kmath::bf16_softmax_shift(max)) instead, and inv_sum[i] = 1 / their sum.
  virtual void causal_softmax_forward(float* scores, float* lse, int64_t rows, int64_t keys,
                                      int64_t first_query, float* inv_sum) = 0;
  // scores (the scaled q k^T forward saw) becomes prob = exp(scores - lse) (0 beyond the causal
  // limit); dp = dL/dprob becomes dL/dscores = prob * (dp - D), D = delta[i] for row i when
  // `delta` is given, else sum(prob * dp) over the row.
  virtual void causal_softmax_backward(float* scores, float* dp, const float* lse, int64_t rows,
                                       int64_t keys, int64_t first_query, const float* delta) = 0;
  // row_loss[r] = log-sum-exp(logits[r]) - logits[r, targets[r]]; with `grad`, the gradient
  // coef * (softmax - onehot(target)) goes into logits, or, when `grad_bf16` is non-null, into
  // grad_bf16 ([rows, vocab] bf16, rounded to nearest even: the values logits would hold, rounded
  // as from_fp32 rounds them; logits' contents are then unspecified). Without `grad` logits is
  // left unchanged. A target < 0 is ignored: the row's loss is 0 and its gradient zeros.
  virtual void cross_entropy(float* logits, const int32_t* targets, int64_t rows, int64_t vocab,
                             float coef, bool grad, float* row_loss, void* grad_bf16) = 0;
  // out[i, :] = table[ids[i], :] as fp32 (table [vocab, hidden] in `dtype` storage).
  virtual void embedding_forward(const void* table, DType dtype, const int32_t* ids, int64_t n,
                                 int64_t hidden, float* out) = 0;
  // grad[ids[i], :] += dy[i, :], in token order.
  virtual void embedding_backward(const int32_t* ids, const float* dy, int64_t n, int64_t hidden,
                                  float* grad) = 0;

  // ---- causal attention with grouped key/value heads
  // Token-major layouts: q and attn [B*T, nh*hd], k and v [B*T, nkv*hd]; head h reads kv head
  // h / (nh / nkv); queries are taken `block` at a time (scores [block, keys] per head).
  // lse[(b*nh + h)*T + t] is what forward keeps for backward.
  // dtype: the storage of q, k, v, attn's saved copy and dattn. F32: fp32 GEMMs, and backward's
  // D = sum(prob * dp) over each row. BF16 (the bf16 compute dtype), as a FlashAttention kernel
  // computes: q k^T and the products with v take bf16 operands; forward rounds the softmax's
  // numerators exp(s - m) to bf16 (m: the row's max rounded up to a multiple of ln 2,
  // kmath::bf16_softmax_shift) and divides their product with v by the row's sum (decision
  // 034); backward rounds the probabilities exp(s - lse) and the score gradients to bf16 before
  // the GEMMs that read them, and its D is the dot of the row's bf16 output and output gradient
  // (kmath::bf16_row_dot); softmax, lse and the accumulators stay fp32.
  struct Attention {
    int64_t B, T, nh, nkv, hd, block;
    float scale;  // 1/sqrt(hd)
    DType dtype = DType::F32;
  };
  // Scratch for dtype BF16 besides `scores` / `dprob`, in bf16 elements (0 with F32): two
  // [block, T] bf16 blocks (the default's probabilities and score gradients), then B*nh*T
  // floats of rows: backward's D (attention_delta), the default forward's 1 / sum of a block.
  static int64_t attention_bf16_scratch(const Attention& a) {
    return a.dtype == DType::BF16 ? 2 * a.block * a.T + 2 * a.B * a.nh * a.T : 0;
  }
  // Where those rows lie in that scratch.
  static float* attention_rows_scratch(const Attention& a, void* lowp) {
    return reinterpret_cast<float*>(static_cast<uint16_t*>(lowp) + 2 * a.block * a.T);
  }
  // attn = softmax_causal(scale q k^T) v per head. `scores`: block*T floats of scratch; `lowp`:
  // attention_bf16_scratch(a) bf16 elements of scratch (null with F32). attn_bf16 (BF16 only,
  // may be null): attn rounded to bf16 goes there instead (as from_fp32 rounds it), attn being
  // scratch. The default runs head by head, block by block, through the backend's gemm /
  // gemm_bf16 and causal softmax; the CPU backend runs its kv heads in parallel, CUDA fused.
  virtual void attention_forward(const Attention& a, const void* q, const void* k, const void* v,
                                 float* lse, float* attn, float* scores, void* lowp,
                                 void* attn_bf16);
  // Given attn (forward's output, in a.dtype: read with BF16 only, may be null with F32) and
  // dattn (in a.dtype): writes dq, adds into dk and dv (fp32; the caller zeroes them). `scores`
  // and `dprob`: block*T floats of scratch each; `lowp` as for forward.
  virtual void attention_backward(const Attention& a, const void* q, const void* k, const void* v,
                                  const float* lse, const void* attn, const void* dattn, float* dq,
                                  float* dk, float* dv, float* scores, float* dprob, void* lowp);
  // BF16 only: delta[(b*nh + h)*T + t] = kmath::bf16_row_dot of head h's hd values of token
  // b*T + t in attn and dattn (both [B*T, nh*hd] bf16): backward's D, the same bits everywhere.
  virtual void attention_delta(const Attention& a, const void* attn, const void* dattn,
                               float* delta) = 0;

 protected:
  // The default attention's work for the query heads of kv head g of sequence b, in its order,
  // on the scratch given: `scores` (and `dprob`) block*T floats; with bf16 operands `p16` (and
  // `ds16`) block*T bf16 elements and, forward, `inv_sum` block floats (all null or unused with
  // F32). Every output it writes is the group's own (its heads' columns of attn and dq, their
  // lse rows, its kv head's columns of dk and dv), so a backend may run groups in parallel, each
  // on scratch of its own (the CPU backend does).
  void attention_forward_group(const Attention& a, int64_t b, int64_t g, const void* q,
                               const void* k, const void* v, float* lse, float* attn, float* scores,
                               void* p16, float* inv_sum);
  void attention_backward_group(const Attention& a, int64_t b, int64_t g, const void* q,
                                const void* k, const void* v, const float* lse, const void* dattn,
                                const float* delta, float* dq, float* dk, float* dv, float* scores,
                                float* dprob, void* p16, void* ds16);
  // The backward's checks and, in bf16, its D (attention_delta into the rows of `lowp`); null
  // with F32.
  const float* attention_backward_delta(const Attention& a, const void* attn, const void* dattn,
                                        void* lowp);
};

// Finishes `backend`'s queued operations, and `also`'s when given (a stream that copies what
// they wrote), when destroyed by an exception's unwinding (their own error dropped: the
// exception in flight is the one that counts), and does nothing otherwise. Declared after the
// device buffers queued operations may still use, it runs before they are freed: on a device
// the host cannot read, freeing them first lets queued compute write into, or a queued copy
// read from, released memory.
class FinishOnUnwind {
 public:
  explicit FinishOnUnwind(ComputeBackend& backend, Stream* also = nullptr)
      : backend_(backend), also_(also), uncaught_(std::uncaught_exceptions()) {}
  ~FinishOnUnwind() {
    if (std::uncaught_exceptions() <= uncaught_) return;
    try {
      backend_.finish();
    } catch (...) {  // the unwinding error is the one reported
    }
    if (also_ == nullptr) return;
    try {
      also_->synchronize();
    } catch (...) {
    }
  }
  FinishOnUnwind(const FinishOnUnwind&) = delete;
  FinishOnUnwind& operator=(const FinishOnUnwind&) = delete;

 private:
  ComputeBackend& backend_;
  Stream* const also_;
  const int uncaught_;
};

// True when the CUDA backend runs attention of shape `a` fused (flash_attention.cu): bf16
// operands, a head size of 16, 32, 64 or 128, within the kernels' grid limits. (It also needs
// every operand's rows on 16 bytes, which the model's buffers give; otherwise the default runs.)
bool fused_attention_shape(const ComputeBackend::Attention& a);

// What a model's computation on a backend of `kind` keeps in device memory besides the model's
// own buffers, every part charged to the device's budget (CUDA; nothing on the CPU backends).
struct WorkspaceShape {
  ComputeBackend::Attention attention{};  // the decoder's attention (B, T, heads, block, dtype)
  int64_t tokens = 0;                     // B * T: the staged token and target ids
  uint64_t constant_bytes = 0;            // the model's constant tables, charged_bytes each
};
struct Workspace {
  uint64_t gemm = 0;       // cuBLASLt's workspace (gemm_workspace_bytes)
  uint64_t attention = 0;  // fp32: two score blocks of every kv head (bf16: none)
  uint64_t ids = 0;        // two id slots and the embedding backward's token groups
  uint64_t constants = 0;  // the constant tables
  uint64_t norm = 0;       // RMSNorm dw's partial sums (norm::kDwPartialBytes)
  uint64_t total() const { return gemm + attention + ids + constants + norm; }
};
Workspace backend_workspace(DeviceKind kind, const WorkspaceShape& shape);
// cuBLASLt's workspace: none unless a program passes OUTCORE_CUBLASLT_WORKSPACE_MB to
// request_gemm_workspace (tools/env_settings.hpp; whole MiB, 0 to kMaxGemmWorkspaceMiB; other
// text keeps the current size with one warning naming `source`). The workspace bounds the
// algorithms cuBLASLt may pick for a shape, and with them the order of its sums, so it is one
// size for every placement and budget of a run: a budget-sized workspace made stage 3 under a
// small budget round differently from stage 1 (decision 032).
inline constexpr uint64_t kMaxGemmWorkspaceMiB = 1024;
uint64_t gemm_workspace_bytes();
void request_gemm_workspace(std::string_view text, std::string_view source);
// The bytes of each part of backend_workspace: the fp32 attention's score blocks, an id slot,
// the token groups' packed array (at most 3n + 1 ints).
uint64_t attention_workspace_bytes(const ComputeBackend::Attention& a);
uint64_t id_slot_bytes(int64_t tokens);
uint64_t token_groups_bytes(int64_t tokens);

class CpuDevice;

// The CPU backend (shared, stateless; never throws): host kernels on host-dereferenceable memory.
std::shared_ptr<ComputeBackend> cpu_backend();
// The CPU backend for `device`: cpu_backend() when the host may dereference its memory, else one
// that turns every device pointer into the device's host view and queues the operations on a
// compute stream of the device (the discrete mode). The backend refers to `device`, which must
// outlive it.
std::shared_ptr<ComputeBackend> make_cpu_backend(CpuDevice& device);
// The CUDA backend of `device` (a CudaDevice made by make_cuda_device): its own compute stream
// on that device and a cuBLASLt GEMM. Throws InvalidArgument when `device` is not a CUDA
// device or the build has no CUDA.
std::unique_ptr<ComputeBackend> make_cuda_backend(Device& device);
// FLOP/s of `backend`'s n^3 GEMM (A B^T, A = B, fp32 output) with operands in `dtype` (F32: gemm,
// BF16: gemm_bf16) on buffers of `device`: one warm-up call, then the best of `reps` timed calls,
// each ended by finish(). The rate the model's GEMMs reach at best on this device.
double gemm_flops(Device& device, ComputeBackend& backend, DType dtype, int64_t n, int reps = 3);
// The model FLOPs of one forward + backward of causal attention `a`: 3 x 4 * nh * hd per
// query-key pair at or below the diagonal (LlamaConfig::attention_flops_per_token, per layer),
// however many products an implementation does.
double attention_train_flops(const ComputeBackend::Attention& a);
// attention_train_flops(a) per second of `backend`'s causal attention of shape `a` (its B, T,
// heads, head size, block and operand dtype) on buffers of `device`: forward then backward, one
// warm-up, then the best of `reps` timed runs, each ended by finish(). The rate the model's
// attention reaches on this device. Throws InvalidArgument for a shape the model never makes
// (a size below 1, heads not a multiple of the kv heads, operands neither fp32 nor bf16).
double attention_flops(Device& device, ComputeBackend& backend, const ComputeBackend::Attention& a,
                       int reps = 3);
// Bytes/s of host<->device copies on `device`: `bytes` of registered host memory up, then down,
// on one stream, best of `reps` round trips (both directions counted). The rate the engine's
// transfers reach at best over the bus (PCIe on a GPU).
double copy_bytes_per_second(Device& device, size_t bytes = size_t{256} << 20, int reps = 3);

// The backend of `device`: make_cuda_backend for a CUDA device, make_cpu_backend for a
// CpuDevice, cpu_backend() for any other host-accessible device. Throws as make_cuda_backend.
std::shared_ptr<ComputeBackend> make_backend(Device& device);

}  // namespace outcore::device
