// ProfilingBackend: where a model's compute time goes, operation by operation. It runs each
// operation on another backend and waits for it there (finish()) before the next, timing each
// on the host clock, and sums the times per operation and shape ("gemm_bf16 NT 4096x14336x4096",
// "attention_backward B1 T4096 32/8x128 bf16"). Waiting after every operation drains the
// device's queue, so the sums are the operations' own times (plus one synchronization each,
// a few microseconds on a GPU) and a profiled step is slower than a real one: a measuring tool
// (model_bench --profile), never the training path. Results are bit-identical to the inner
// backend's: every operation is forwarded unchanged.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/device/compute_backend.hpp"

namespace outcore::device {

class ProfilingBackend : public ComputeBackend {
 public:
  // One operation and shape: how often it ran, its time, and its FLOPs (GEMMs: 2mnk; causal
  // attention: its GEMMs over the query-key pairs at or below the diagonal, the backward
  // counting the scores' recomputation; 0 for the rest).
  struct Row {
    std::string op;
    int64_t calls = 0;
    double seconds = 0;
    double flops = 0;
  };

  // Throws InvalidArgument when `inner` is null.
  explicit ProfilingBackend(std::shared_ptr<ComputeBackend> inner);

  // The rows, most time first.
  std::vector<Row> rows() const;
  double total_seconds() const;
  void reset() { rows_.clear(); }

  std::string name() const override { return inner_->name(); }
  void copy(void* dst, const void* src, size_t bytes) override;
  void zero(void* dst, size_t bytes) override;
  void upload(void* dst, const void* host, size_t bytes) override;
  void download(void* host, const void* src, size_t bytes) override;
  const float* constant(std::span<const float> host) override { return inner_->constant(host); }
  const int32_t* stage_ids(const int32_t* host, int64_t n, int slot) override;
  void finish() override { inner_->finish(); }
  uint64_t device_bytes() const override { return inner_->device_bytes(); }
  uint64_t workspace_bytes(const WorkspaceShape& shape) const override {
    return inner_->workspace_bytes(shape);
  }
  const Device* device() const override { return inner_->device(); }
  void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
            const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
            int64_t ldc) override;
  void gemm_bf16(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                 const void* a, int64_t lda, const void* b, int64_t ldb, float beta, float* c,
                 int64_t ldc) override;
  void to_fp32(const void* src, DType dtype, float* dst, int64_t n) override;
  void from_fp32(const float* src, void* dst, DType dtype, int64_t n) override;
  void add_inplace(float* y, const float* x, int64_t n) override;
  void scale_rows(float* x, int64_t rows, int64_t cols, int64_t ld, const float* scale) override;
  void rmsnorm_forward(const float* x, const float* w, float eps, int64_t rows, int64_t dim,
                       float* y, float* rstd, void* y_bf16) override;
  void rmsnorm_backward(const float* dy, const float* x, const float* w, const float* rstd,
                        int64_t rows, int64_t dim, float* dx, float* dw) override;
  void rope(float* x, int64_t rows, int64_t seq, int64_t heads, int64_t head_dim, const float* cos,
            const float* sin, bool inverse, void* x_bf16) override;
  void swiglu_forward(const float* g, const float* u, float* a, int64_t n, void* a_bf16) override;
  void swiglu_backward(const float* da, const float* g, const float* u, float* dg, float* du,
                       int64_t n, void* dg_bf16, void* du_bf16) override;
  void causal_softmax_forward(float* scores, float* lse, int64_t rows, int64_t keys,
                              int64_t first_query, float* inv_sum) override;
  void causal_softmax_backward(float* scores, float* dp, const float* lse, int64_t rows,
                               int64_t keys, int64_t first_query, const float* delta) override;
  void cross_entropy(float* logits, const int32_t* targets, int64_t rows, int64_t vocab, float coef,
                     bool grad, float* row_loss, void* grad_bf16) override;
  void embedding_forward(const void* table, DType dtype, const int32_t* ids, int64_t n,
                         int64_t hidden, float* out) override;
  void embedding_backward(const int32_t* ids, const float* dy, int64_t n, int64_t hidden,
                          float* grad) override;
  void attention_forward(const Attention& a, const void* q, const void* k, const void* v,
                         float* lse, float* attn, float* scores, void* lowp,
                         void* attn_bf16) override;
  void attention_backward(const Attention& a, const void* q, const void* k, const void* v,
                          const float* lse, const void* attn, const void* dattn, float* dq,
                          float* dk, float* dv, float* scores, float* dprob, void* lowp) override;
  void attention_delta(const Attention& a, const void* attn, const void* dattn,
                       float* delta) override;

 private:
  // Runs fn on the inner backend, waits for it, and adds the time to the row `op`.
  template <typename Fn>
  void timed(const std::string& op, double flops, Fn&& fn);

  std::shared_ptr<ComputeBackend> inner_;
  std::map<std::string, Row> rows_;
};

}  // namespace outcore::device
