// The CUDA compute backend (see compute_backend.hpp): every operation is a kernel of
// cuda_kernels.hpp, a cuBLASLt GEMM or an async copy, queued on the backend's own compute
// stream of a CudaDevice; finish() synchronizes that stream. Every operation first makes the
// backend's GPU current on the calling thread (CUDA's current device is per thread: a thread of
// the engine that never chose one would launch on GPU 0). Compiled only where nvcc exists.
//
// Everything the backend keeps in device memory comes from the device's allocator and is
// charged to its byte budget (device_bytes(); the planner counts the same bytes through
// backend_workspace): cuBLASLt's workspace (gemm_workspace_bytes), the constant tables, the
// staged token / target ids and token groups, RMSNorm's weight-gradient partial sums
// (rmsnorm_dw_split.hpp: 64 KiB), and the fp32 attention's score blocks of all kv heads at once (2
// x nkv x 128 x T floats: 32 MiB for 8 kv heads at T = 4096; bf16 attention keeps its D on the
// model's scratch). Only the ids' pinned host staging is not.
//
// Attention with bf16 operands (the bf16 compute dtype) runs fused (flash_attention.cu: no score
// matrix in device memory) for head sizes 16, 32, 64 and 128, else through the default's
// head-by-head GEMMs. fp32 attention runs the heads batched: for each sequence, each query
// block and each position j of a head within its kv group, one strided-batched GEMM over the
// nkv groups (head g*group + j reads kv head g), one causal softmax over all their rows, one
// more GEMM: the launches per layer drop by a factor nkv against the head-by-head default.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <string_view>
#include <vector>

#include "common/error.hpp"
#include "engine/device/compute_backend.hpp"
#include "engine/device/cuda/cuda_check.hpp"
#include "engine/device/cuda/cuda_kernels.hpp"
#include "engine/device/device.hpp"
#include "engine/device/rmsnorm_dw_split.hpp"
#include "engine/device/token_groups.hpp"

namespace outcore::device {
namespace {

class CudaBackend final : public ComputeBackend {
 public:
  explicit CudaBackend(Device& device) : device_(device), name_(device.name()) {
    stream_ = device.create_stream("compute");  // makes the device current on this thread
    CUDA_CHECK(cudaGetDevice(&ordinal_));
    handle_ = stream_->native_handle();
    gemm_workspace_ = device.alloc(gemm_workspace_bytes(), "cuBLASLt workspace");
    gemm_ = std::make_unique<cuda::Gemm>(gemm_workspace_.data(), gemm_workspace_.size());
    norm_partials_ = device.alloc(norm::kDwPartialBytes, "RMSNorm weight-gradient partial sums");
  }
  ~CudaBackend() override {
    (void)cudaSetDevice(ordinal_);
    cudaStreamSynchronize(native());  // then the buffers below go back to the device
    for (IdSlot* s : {&ids_[0], &ids_[1], &groups_}) cudaFreeHost(s->host);
    if (groups_copied_ != nullptr) cudaEventDestroy(groups_copied_);
    for (IdSlot& s : ids_)
      if (s.copied != nullptr) cudaEventDestroy(s.copied);
  }

  const Device* device() const override { return &device_; }
  uint64_t workspace_bytes(const WorkspaceShape& shape) const override {
    return backend_workspace(DeviceKind::Cuda, shape).total();
  }
  uint64_t device_bytes() const override {
    uint64_t n = charged_bytes(gemm_workspace_.size()) + charged_bytes(work_.size()) +
                 charged_bytes(norm_partials_.size());
    for (const DeviceBuffer& c : constants_) n += charged_bytes(c.size());
    for (const IdSlot* s : {&ids_[0], &ids_[1], &groups_}) n += charged_bytes(s->device.size());
    return n;
  }

  std::string name() const override { return name_; }

  void copy(void* dst, const void* src, size_t bytes) override {
    current();
    if (bytes == 0 || dst == src) return;
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, native()));
  }
  void zero(void* dst, size_t bytes) override {
    current();
    if (bytes != 0) CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, native()));
  }
  void upload(void* dst, const void* host, size_t bytes) override {
    current();
    if (bytes == 0) return;
    // From pageable memory the call returns once `host` has been staged by the driver; from
    // page-locked memory the copy reads `host` later, so the stream is waited for (the contract:
    // `host` is not read after this returns).
    CUDA_CHECK(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, native()));
    cudaPointerAttributes at{};
    CUDA_CHECK(cudaPointerGetAttributes(&at, host));
    if (at.type == cudaMemoryTypeHost) CUDA_CHECK(cudaStreamSynchronize(native()));
  }
  void download(void* host, const void* src, size_t bytes) override {
    current();
    if (bytes == 0) return;
    CUDA_CHECK(cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost, native()));
    CUDA_CHECK(cudaStreamSynchronize(native()));
  }
  const float* constant(std::span<const float> host) override {
    DeviceBuffer& d = constants_.emplace_back(device_.alloc(host.size_bytes(), "constant table"));
    current();
    if (d) {
      // On the compute stream (a non-blocking stream: cudaMemcpy's legacy stream would not order
      // the kernels that read the table after the copy), and waited for: `host` is pageable.
      CUDA_CHECK(cudaMemcpyAsync(d.data(), host.data(), host.size_bytes(), cudaMemcpyHostToDevice,
                                 native()));
      CUDA_CHECK(cudaStreamSynchronize(native()));
    }
    return d.as<const float>();
  }
  const int32_t* stage_ids(const int32_t* host, int64_t n, int slot) override {
    if (slot < 0 || slot > 1) throw InvalidArgument("stage_ids: slot must be 0 or 1");
    IdSlot& s = ids_[slot];
    const size_t bytes = static_cast<size_t>(n) * sizeof(int32_t);
    current();
    if (s.copied == nullptr)
      CUDA_CHECK(cudaEventCreateWithFlags(&s.copied, cudaEventDisableTiming));
    if (bytes > s.capacity) {
      resize(s, bytes, "staged token ids");
    } else {
      // The pinned staging copy of this slot's previous ids may still be in flight: wait for
      // that copy alone, not for the compute queued since (the device copy is overwritten in
      // stream order, after what reads it).
      CUDA_CHECK(cudaEventSynchronize(s.copied));
    }
    std::memcpy(s.host, host, bytes);
    CUDA_CHECK(cudaMemcpyAsync(s.device.data(), s.host, bytes, cudaMemcpyHostToDevice, native()));
    CUDA_CHECK(cudaEventRecord(s.copied, native()));
    return s.device.as<const int32_t>();
  }
  void finish() override {
    current();
    stream_->synchronize();  // also rethrows an error of a stream the compute stream waited on
    CUDA_CHECK(cudaGetLastError());
  }
  Stream* stream() override { return stream_.get(); }

  void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
            const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
            int64_t ldc) override {
    if (m == 0 || n == 0) return;
    current();
    gemm_->run(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, DType::F32, beta, c, ldc, handle_);
  }
  void gemm_bf16(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                 const void* a, int64_t lda, const void* b, int64_t ldb, float beta, float* c,
                 int64_t ldc) override {
    if (m == 0 || n == 0) return;
    current();
    gemm_->run(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, DType::BF16, beta, c, ldc,
               handle_);
  }
  void to_fp32(const void* src, DType dtype, float* dst, int64_t n) override {
    current();
    cuda::to_fp32(src, dtype, dst, n, handle_);
  }
  void from_fp32(const float* src, void* dst, DType dtype, int64_t n) override {
    current();
    cuda::from_fp32(src, dst, dtype, n, handle_);
  }
  void add_inplace(float* y, const float* x, int64_t n) override {
    current();
    cuda::add_inplace(y, x, n, handle_);
  }
  void scale_rows(float* x, int64_t rows, int64_t cols, int64_t ld, const float* scale) override {
    current();
    cuda::scale_rows(x, rows, cols, ld, scale, handle_);
  }
  void rmsnorm_forward(const float* x, const float* w, float eps, int64_t rows, int64_t dim,
                       float* y, float* rstd, void* y_bf16) override {
    current();
    cuda::rmsnorm_forward(x, w, eps, rows, dim, y, rstd, handle_, static_cast<uint16_t*>(y_bf16));
  }
  void rmsnorm_backward(const float* dy, const float* x, const float* w, const float* rstd,
                        int64_t rows, int64_t dim, float* dx, float* dw) override {
    current();
    cuda::rmsnorm_backward(dy, x, w, rstd, rows, dim, dx, dw, norm_partials_.as<float>(), handle_);
  }
  void rope(float* x, int64_t rows, int64_t seq, int64_t heads, int64_t head_dim, const float* cos,
            const float* sin, bool inverse, void* x_bf16) override {
    current();
    cuda::rope(x, rows, seq, heads, head_dim, cos, sin, inverse, handle_,
               static_cast<uint16_t*>(x_bf16));
  }
  void swiglu_forward(const float* g, const float* u, float* a, int64_t n, void* a_bf16) override {
    current();
    cuda::swiglu_forward(g, u, a, n, handle_, static_cast<uint16_t*>(a_bf16));
  }
  void swiglu_backward(const float* da, const float* g, const float* u, float* dg, float* du,
                       int64_t n, void* dg_bf16, void* du_bf16) override {
    current();
    cuda::swiglu_backward(da, g, u, dg, du, n, handle_, static_cast<uint16_t*>(dg_bf16),
                          static_cast<uint16_t*>(du_bf16));
  }
  void causal_softmax_forward(float* scores, float* lse, int64_t rows, int64_t keys,
                              int64_t first_query, float* inv_sum) override {
    current();
    cuda::causal_softmax_forward(scores, lse, 1, rows, keys, first_query, handle_, 0, inv_sum);
  }
  void causal_softmax_backward(float* scores, float* dp, const float* lse, int64_t rows,
                               int64_t keys, int64_t first_query, const float* delta) override {
    current();
    cuda::causal_softmax_backward(scores, dp, lse, 1, rows, keys, first_query, handle_, 0, delta);
  }
  void attention_delta(const Attention& a, const void* attn, const void* dattn,
                       float* delta) override {
    if (a.dtype != DType::BF16) throw InvalidArgument("attention_delta: bf16 operands only");
    current();
    cuda::attention_delta(bits(attn), bits(dattn), a.B, a.T, a.nh, a.hd, delta, handle_);
  }
  void cross_entropy(float* logits, const int32_t* targets, int64_t rows, int64_t vocab, float coef,
                     bool grad, float* row_loss, void* grad_bf16) override {
    current();
    cuda::cross_entropy(logits, targets, rows, vocab, coef, grad, row_loss, handle_,
                        static_cast<uint16_t*>(grad_bf16));
  }
  void embedding_forward(const void* table, DType dtype, const int32_t* ids, int64_t n,
                         int64_t hidden, float* out) override {
    current();
    cuda::embedding_forward(table, dtype, ids, n, hidden, out, handle_);
  }
  // The ids are grouped on the host (from the staged host copy when `ids` came from
  // stage_ids, else read back) and the groups copied up once.
  void embedding_backward(const int32_t* ids, const float* dy, int64_t n, int64_t hidden,
                          float* grad) override {
    current();
    if (n == 0) return;
    std::vector<int32_t> read_back;
    const int32_t* host = nullptr;
    for (const IdSlot& s : ids_)
      if (s.device.data() == ids && s.capacity >= static_cast<size_t>(n) * sizeof(int32_t))
        host = static_cast<const int32_t*>(s.host);
    if (host == nullptr) {
      read_back.resize(static_cast<size_t>(n));
      download(read_back.data(), ids, read_back.size() * sizeof(int32_t));
      host = read_back.data();
    }
    const TokenGroups groups({host, static_cast<size_t>(n)});
    const int32_t* staged = stage_groups(groups.packed(), n);
    cuda::embedding_backward(staged, n, groups.groups(), dy, hidden, grad, handle_);
  }

  void attention_forward(const Attention& a, const void* qv, const void* kv, const void* vv,
                         float* lse, float* attn, float* scores, void* lowp,
                         void* attn_bf16) override {
    current();
    if (fused(a, {qv, kv, vv})) {
      cuda::flash_attention_forward(bits(qv), bits(kv), bits(vv), a.B, a.T, a.nh, a.nkv, a.hd,
                                    a.scale, lse, attn, handle_, static_cast<uint16_t*>(attn_bf16));
      return;
    }
    // Other bf16 shapes: the default's head-by-head GEMMs on cuBLASLt bf16.
    if (a.dtype != DType::F32 || attn_bf16 != nullptr)
      return ComputeBackend::attention_forward(a, qv, kv, vv, lse, attn, scores, lowp, attn_bf16);
    const auto* q = static_cast<const float*>(qv);
    const auto* k = static_cast<const float*>(kv);
    const auto* v = static_cast<const float*>(vv);
    const int64_t Q = a.nh * a.hd, KV = a.nkv * a.hd, group = a.nh / a.nkv;
    float* s = grown(work_, attention_workspace_bytes(a), "attention score blocks");
    for (int64_t b = 0; b < a.B; ++b)
      for (int64_t j = 0; j < group; ++j)
        for (int64_t r0 = 0; r0 < a.T; r0 += a.block) {
          const int64_t rows = std::min(a.block, a.T - r0), keys = r0 + rows;
          // Batch entry g: head h = g*group + j, its queries at column h*hd, kv head g.
          const float* qb = q + (b * a.T + r0) * Q + j * a.hd;
          const float* kb = k + b * a.T * KV;
          const float* vb = v + b * a.T * KV;
          gemm_->run(false, true, rows, keys, a.hd, a.scale, qb, Q, kb, KV, DType::F32, 0.0f, s,
                     keys, handle_, a.nkv, group * a.hd, a.hd, rows * keys);
          cuda::causal_softmax_forward(s, lse + (b * a.nh + j) * a.T + r0, a.nkv, rows, keys, r0,
                                       handle_, group * a.T);
          gemm_->run(false, false, rows, a.hd, keys, 1.0f, s, keys, vb, KV, DType::F32, 0.0f,
                     attn + (b * a.T + r0) * Q + j * a.hd, Q, handle_, a.nkv, rows * keys, a.hd,
                     group * a.hd);
        }
  }

  void attention_backward(const Attention& a, const void* qv, const void* kv, const void* vv,
                          const float* lse, const void* attn, const void* dattnv, float* dq,
                          float* dk, float* dv, float* scores, float* dprob, void* lowp) override {
    current();
    if (fused(a, {qv, kv, vv, dattnv})) {
      if (attn == nullptr || lowp == nullptr)
        throw InvalidArgument("attention backward: bf16 needs forward's output and the scratch");
      cuda::flash_attention_backward(bits(qv), bits(kv), bits(vv), lse, bits(attn), bits(dattnv),
                                     a.B, a.T, a.nh, a.nkv, a.hd, a.scale,
                                     attention_rows_scratch(a, lowp), dq, dk, dv, handle_);
      return;
    }
    if (a.dtype != DType::F32)
      return ComputeBackend::attention_backward(a, qv, kv, vv, lse, attn, dattnv, dq, dk, dv,
                                                scores, dprob, lowp);
    const auto* q = static_cast<const float*>(qv);
    const auto* k = static_cast<const float*>(kv);
    const auto* v = static_cast<const float*>(vv);
    const auto* dattn = static_cast<const float*>(dattnv);
    const int64_t Q = a.nh * a.hd, KV = a.nkv * a.hd, group = a.nh / a.nkv;
    float* p = grown(work_, attention_workspace_bytes(a), "attention score blocks");
    float* ds = p + a.nkv * a.block * a.T;
    for (int64_t b = 0; b < a.B; ++b)
      for (int64_t j = 0; j < group; ++j)
        for (int64_t r0 = 0; r0 < a.T; r0 += a.block) {
          const int64_t rows = std::min(a.block, a.T - r0), keys = r0 + rows;
          const int64_t q_at = (b * a.T + r0) * Q + j * a.hd, kv_at = b * a.T * KV;
          const int64_t sq = group * a.hd, skv = a.hd, ss = rows * keys;
          gemm_->run(false, true, rows, keys, a.hd, a.scale, q + q_at, Q, k + kv_at, KV, DType::F32,
                     0.0f, p, keys, handle_, a.nkv, sq, skv, ss);
          gemm_->run(false, true, rows, keys, a.hd, 1.0f, dattn + q_at, Q, v + kv_at, KV,
                     DType::F32, 0.0f, ds, keys, handle_, a.nkv, sq, skv, ss);
          cuda::causal_softmax_backward(p, ds, lse + (b * a.nh + j) * a.T + r0, a.nkv, rows, keys,
                                        r0, handle_, group * a.T);
          gemm_->run(false, false, rows, a.hd, keys, a.scale, ds, keys, k + kv_at, KV, DType::F32,
                     0.0f, dq + q_at, Q, handle_, a.nkv, ss, skv, sq);
          // dk, dv of kv head g gather every head of its group: one batched call per j, in
          // order, each writing distinct kv heads.
          gemm_->run(true, false, keys, a.hd, rows, a.scale, ds, keys, q + q_at, Q, DType::F32,
                     1.0f, dk + kv_at, KV, handle_, a.nkv, ss, sq, skv);
          gemm_->run(true, false, keys, a.hd, rows, 1.0f, p, keys, dattn + q_at, Q, DType::F32,
                     1.0f, dv + kv_at, KV, handle_, a.nkv, ss, sq, skv);
        }
  }

 private:
  struct IdSlot {
    DeviceBuffer device;
    void* host = nullptr;  // pinned staging
    size_t capacity = 0;
    cudaEvent_t copied = nullptr;  // the staging's last upload (stage_ids' slots)
  };

  // bf16 attention goes to the fused kernels where they take the head size and every operand's
  // rows start on 16 bytes (the kernels' vector loads).
  static bool fused(const Attention& a, std::initializer_list<const void*> operands) {
    if (!fused_attention_shape(a) || !cuda::flash_attention_supported(a.hd)) return false;
    for (const void* p : operands)
      if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
    return true;
  }
  static const uint16_t* bits(const void* p) { return static_cast<const uint16_t*>(p); }

  // `buffer` grown to at least `bytes` (attention_workspace_bytes of the model's one attention
  // shape: allocated once); the stream is synchronized before the old one is freed.
  float* grown(DeviceBuffer& buffer, size_t bytes, std::string_view what) {
    if (bytes > buffer.size()) {
      CUDA_CHECK(cudaStreamSynchronize(native()));
      buffer.reset();
      buffer = device_.alloc(bytes, what);
    }
    return buffer.as<float>();
  }

  // Slot `s` holding `bytes`: its device buffer from the device's budget, its staging pinned.
  // The stream is synchronized first: the old buffers may still be read.
  void resize(IdSlot& s, size_t bytes, std::string_view what) {
    CUDA_CHECK(cudaStreamSynchronize(native()));
    s.device.reset();
    CUDA_CHECK(cudaFreeHost(s.host));
    s.host = nullptr;
    s.capacity = 0;
    s.device = device_.alloc(bytes, what);
    CUDA_CHECK(cudaMallocHost(&s.host, bytes));
    s.capacity = bytes;
  }

  // groups.packed() in device memory through a pinned staging copy (the previous copy has
  // finished before the staging is reused: an event, not a stream synchronize).
  const int32_t* stage_groups(const std::vector<int32_t>& packed, int64_t tokens) {
    const size_t bytes = packed.size() * sizeof(int32_t);
    if (groups_copied_ == nullptr)
      CUDA_CHECK(cudaEventCreateWithFlags(&groups_copied_, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventSynchronize(groups_copied_));
    if (bytes > groups_.capacity)  // room for any micro-batch of these tokens: 3n + 1 ints
      resize(groups_, std::max<size_t>(bytes, token_groups_bytes(tokens)), "token groups");
    std::memcpy(groups_.host, packed.data(), bytes);
    CUDA_CHECK(cudaMemcpyAsync(groups_.device.data(), groups_.host, bytes, cudaMemcpyHostToDevice,
                               native()));
    CUDA_CHECK(cudaEventRecord(groups_copied_, native()));
    return groups_.device.as<const int32_t>();
  }

  cudaStream_t native() const { return static_cast<cudaStream_t>(handle_); }
  void current() const { CUDA_CHECK(cudaSetDevice(ordinal_)); }

  Device& device_;
  std::string name_;
  int ordinal_ = 0;
  std::unique_ptr<Stream> stream_;
  void* handle_ = nullptr;  // stream_'s cudaStream_t
  DeviceBuffer gemm_workspace_;
  std::unique_ptr<cuda::Gemm> gemm_;
  std::vector<DeviceBuffer> constants_;
  IdSlot ids_[2];
  IdSlot groups_;                        // the embedding backward's token groups
  cudaEvent_t groups_copied_ = nullptr;  // groups_'s last upload
  DeviceBuffer work_;                    // attention score blocks (fp32 attention)
  DeviceBuffer norm_partials_;           // RMSNorm dw's row ranges (norm::kDwPartialBytes)
};

}  // namespace

std::unique_ptr<ComputeBackend> make_cuda_backend(Device& device) {
  if (device.kind() != DeviceKind::Cuda)
    throw InvalidArgument("make_cuda_backend: device " + device.name() + " is not a CUDA device");
  return std::make_unique<CudaBackend>(device);
}

}  // namespace outcore::device
