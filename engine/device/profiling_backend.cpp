#include "engine/device/profiling_backend.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <utility>

#include "common/error.hpp"

namespace outcore::device {
namespace {

std::string gemm_key(const char* op, bool ta, bool tb, int64_t m, int64_t n, int64_t k) {
  return fmt::format("{} {}{} {}x{}x{}", op, ta ? 'T' : 'N', tb ? 'T' : 'N', m, n, k);
}

std::string attention_key(const char* op, const ComputeBackend::Attention& a) {
  return fmt::format("{} B{} T{} {}/{}x{} {}", op, a.B, a.T, a.nh, a.nkv, a.hd,
                     dtype_name(a.dtype));
}

// The multiply-adds of one causal product over all heads, x2: T(T+1)/2 query-key pairs of hd.
double causal_gemm_flops(const ComputeBackend::Attention& a) {
  return 2.0 * double(a.B) * double(a.nh) * double(a.hd) * double(a.T) * double(a.T + 1) / 2.0;
}

}  // namespace

ProfilingBackend::ProfilingBackend(std::shared_ptr<ComputeBackend> inner)
    : inner_(std::move(inner)) {
  if (!inner_) throw InvalidArgument("ProfilingBackend: no backend to profile");
}

template <typename Fn>
void ProfilingBackend::timed(const std::string& op, double flops, Fn&& fn) {
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  fn(*inner_);
  inner_->finish();
  Row& r = rows_[op];
  r.op = op;
  r.calls += 1;
  r.seconds += std::chrono::duration<double>(Clock::now() - t0).count();
  r.flops += flops;
}

std::vector<ProfilingBackend::Row> ProfilingBackend::rows() const {
  std::vector<Row> out;
  for (const auto& [op, r] : rows_) out.push_back(r);
  std::stable_sort(out.begin(), out.end(),
                   [](const Row& a, const Row& b) { return a.seconds > b.seconds; });
  return out;
}

double ProfilingBackend::total_seconds() const {
  double s = 0;
  for (const auto& [op, r] : rows_) s += r.seconds;
  return s;
}

void ProfilingBackend::copy(void* dst, const void* src, size_t bytes) {
  timed("copy", 0, [&](ComputeBackend& b) { b.copy(dst, src, bytes); });
}
void ProfilingBackend::zero(void* dst, size_t bytes) {
  timed("zero", 0, [&](ComputeBackend& b) { b.zero(dst, bytes); });
}
void ProfilingBackend::upload(void* dst, const void* host, size_t bytes) {
  timed("upload", 0, [&](ComputeBackend& b) { b.upload(dst, host, bytes); });
}
void ProfilingBackend::download(void* host, const void* src, size_t bytes) {
  timed("download", 0, [&](ComputeBackend& b) { b.download(host, src, bytes); });
}
const int32_t* ProfilingBackend::stage_ids(const int32_t* host, int64_t n, int slot) {
  const int32_t* out = nullptr;
  timed("stage_ids", 0, [&](ComputeBackend& b) { out = b.stage_ids(host, n, slot); });
  return out;
}
void ProfilingBackend::gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
                            const float* a, int64_t lda, const float* b, int64_t ldb, float beta,
                            float* c, int64_t ldc) {
  timed(gemm_key("gemm", ta, tb, m, n, k), 2.0 * double(m) * double(n) * double(k),
        [&](ComputeBackend& be) { be.gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc); });
}
void ProfilingBackend::gemm_bf16(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
                                 const void* a, int64_t lda, const void* b, int64_t ldb, float beta,
                                 float* c, int64_t ldc) {
  timed(gemm_key("gemm_bf16", ta, tb, m, n, k), 2.0 * double(m) * double(n) * double(k),
        [&](ComputeBackend& be) {
          be.gemm_bf16(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
        });
}
void ProfilingBackend::to_fp32(const void* src, DType dtype, float* dst, int64_t n) {
  timed(fmt::format("to_fp32 {}", dtype_name(dtype)), 0,
        [&](ComputeBackend& b) { b.to_fp32(src, dtype, dst, n); });
}
void ProfilingBackend::from_fp32(const float* src, void* dst, DType dtype, int64_t n) {
  timed(fmt::format("from_fp32 {}", dtype_name(dtype)), 0,
        [&](ComputeBackend& b) { b.from_fp32(src, dst, dtype, n); });
}
void ProfilingBackend::add_inplace(float* y, const float* x, int64_t n) {
  timed("add_inplace", 0, [&](ComputeBackend& b) { b.add_inplace(y, x, n); });
}
void ProfilingBackend::scale_rows(float* x, int64_t rows, int64_t cols, int64_t ld,
                                  const float* scale) {
  timed("scale_rows", 0, [&](ComputeBackend& b) { b.scale_rows(x, rows, cols, ld, scale); });
}
void ProfilingBackend::rmsnorm_forward(const float* x, const float* w, float eps, int64_t rows,
                                       int64_t dim, float* y, float* rstd, void* y_bf16) {
  timed(fmt::format("rmsnorm_forward {}x{}", rows, dim), 0,
        [&](ComputeBackend& b) { b.rmsnorm_forward(x, w, eps, rows, dim, y, rstd, y_bf16); });
}
void ProfilingBackend::rmsnorm_backward(const float* dy, const float* x, const float* w,
                                        const float* rstd, int64_t rows, int64_t dim, float* dx,
                                        float* dw) {
  timed(fmt::format("rmsnorm_backward {}x{}", rows, dim), 0,
        [&](ComputeBackend& b) { b.rmsnorm_backward(dy, x, w, rstd, rows, dim, dx, dw); });
}
void ProfilingBackend::rope(float* x, int64_t rows, int64_t seq, int64_t heads, int64_t head_dim,
                            const float* cos, const float* sin, bool inverse, void* x_bf16) {
  timed(inverse ? "rope inverse" : "rope", 0, [&](ComputeBackend& b) {
    b.rope(x, rows, seq, heads, head_dim, cos, sin, inverse, x_bf16);
  });
}
void ProfilingBackend::swiglu_forward(const float* g, const float* u, float* a, int64_t n,
                                      void* a_bf16) {
  timed("swiglu_forward", 0, [&](ComputeBackend& b) { b.swiglu_forward(g, u, a, n, a_bf16); });
}
void ProfilingBackend::swiglu_backward(const float* da, const float* g, const float* u, float* dg,
                                       float* du, int64_t n, void* dg_bf16, void* du_bf16) {
  timed("swiglu_backward", 0,
        [&](ComputeBackend& b) { b.swiglu_backward(da, g, u, dg, du, n, dg_bf16, du_bf16); });
}
void ProfilingBackend::causal_softmax_forward(float* scores, float* lse, int64_t rows, int64_t keys,
                                              int64_t first_query, float* inv_sum) {
  timed("causal_softmax_forward", 0, [&](ComputeBackend& b) {
    b.causal_softmax_forward(scores, lse, rows, keys, first_query, inv_sum);
  });
}
void ProfilingBackend::causal_softmax_backward(float* scores, float* dp, const float* lse,
                                               int64_t rows, int64_t keys, int64_t first_query,
                                               const float* delta) {
  timed("causal_softmax_backward", 0, [&](ComputeBackend& b) {
    b.causal_softmax_backward(scores, dp, lse, rows, keys, first_query, delta);
  });
}
void ProfilingBackend::cross_entropy(float* logits, const int32_t* targets, int64_t rows,
                                     int64_t vocab, float coef, bool grad, float* row_loss,
                                     void* grad_bf16) {
  timed(fmt::format("cross_entropy {}x{}", rows, vocab), 0, [&](ComputeBackend& b) {
    b.cross_entropy(logits, targets, rows, vocab, coef, grad, row_loss, grad_bf16);
  });
}
void ProfilingBackend::embedding_forward(const void* table, DType dtype, const int32_t* ids,
                                         int64_t n, int64_t hidden, float* out) {
  timed("embedding_forward", 0,
        [&](ComputeBackend& b) { b.embedding_forward(table, dtype, ids, n, hidden, out); });
}
void ProfilingBackend::embedding_backward(const int32_t* ids, const float* dy, int64_t n,
                                          int64_t hidden, float* grad) {
  timed("embedding_backward", 0,
        [&](ComputeBackend& b) { b.embedding_backward(ids, dy, n, hidden, grad); });
}
void ProfilingBackend::attention_forward(const Attention& a, const void* q, const void* k,
                                         const void* v, float* lse, float* attn, float* scores,
                                         void* lowp, void* attn_bf16) {
  // q k^T and p v.
  timed(attention_key("attention_forward", a), 2 * causal_gemm_flops(a), [&](ComputeBackend& b) {
    b.attention_forward(a, q, k, v, lse, attn, scores, lowp, attn_bf16);
  });
}
void ProfilingBackend::attention_backward(const Attention& a, const void* q, const void* k,
                                          const void* v, const float* lse, const void* attn,
                                          const void* dattn, float* dq, float* dk, float* dv,
                                          float* scores, float* dprob, void* lowp) {
  // q k^T again, dattn v^T, p^T dattn, ds k, ds^T q (and D, on the inner backend's own call).
  timed(attention_key("attention_backward", a), 5 * causal_gemm_flops(a), [&](ComputeBackend& b) {
    b.attention_backward(a, q, k, v, lse, attn, dattn, dq, dk, dv, scores, dprob, lowp);
  });
}
void ProfilingBackend::attention_delta(const Attention& a, const void* attn, const void* dattn,
                                       float* delta) {
  timed(attention_key("attention_delta", a), 0,
        [&](ComputeBackend& b) { b.attention_delta(a, attn, dattn, delta); });
}

}  // namespace outcore::device
