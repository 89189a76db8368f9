// Head unit: final RMSNorm, output projection (lm_head or the tied embedding) and
// cross-entropy, computed chunk by chunk of rows so that all logits never exist at once.
#include <cmath>
#include <cstring>

#include "engine/device/kernel_math.hpp"
#include "engine/model/kernels.hpp"
#include "engine/model/unit_internal.hpp"

namespace outcore::model::detail {
namespace {

using kernels::gemm;

// Vocabulary rows converted to fp32 at once when the head weight is not stored in fp32.
int64_t vocab_block(const LlamaConfig& c, const ModelOptions& o) {
  if (o.param_dtype == DType::F32) return c.vocab_size;
  return std::min<int64_t>(c.vocab_size, std::max<int64_t>(1, (int64_t{1} << 20) / c.hidden_size));
}

struct HeadWork {
  float *xn, *rstd, *wn, *logits, *wtmp, *dxn;
};

HeadWork carve(Arena& ar, const LlamaConfig& c, const ModelOptions& o) {
  const int64_t n = o.micro_batch * o.seq_len, h = c.hidden_size;
  HeadWork w;
  w.xn = ar.floats(n * h);
  w.rstd = ar.floats(n);
  w.wn = ar.floats(h);
  w.logits = ar.floats(head_chunk_rows(c, o) * c.vocab_size);
  w.wtmp = ar.floats(o.param_dtype == DType::F32 ? 0 : vocab_block(c, o) * h);
  w.dxn = ar.floats(n * h);
  return w;
}

struct HeadWeight {
  const void* slab;
  const TensorSpec* spec;
};

HeadWeight head_weight(const UnitContext& ctx, const void* params, const void* tied_params) {
  if (ctx.cfg.tie_word_embeddings) {
    if (tied_params == nullptr)
      throw InvalidArgument(
          "head: tie_word_embeddings needs the embedding unit's slab (tied_params)");
    return {tied_params, &ctx.embed.tensors[0]};
  }
  return {params, &ctx.unit.tensors[1]};
}

// logits[rows, vocab] (leading dimension vocab) = xn[rows, hidden] W^T.
void project(const UnitContext& ctx, const HeadWeight& hw, const float* xn, int64_t rows,
             float* logits, float* wtmp) {
  const int64_t V = ctx.cfg.vocab_size, H = ctx.cfg.hidden_size, vb = vocab_block(ctx.cfg, ctx.opt);
  for (int64_t v0 = 0; v0 < V; v0 += vb) {
    const int64_t n = std::min(vb, V - v0);
    const float* W = weight_f32(ctx, hw.slab, *hw.spec, wtmp, v0 * H, n * H);
    gemm(false, true, rows, n, H, 1.0f, xn, H, W, H, 0.0f, logits + v0, V);
  }
}

}  // namespace

int64_t head_chunk_rows(const LlamaConfig& c, const ModelOptions& o) {
  const int64_t n = o.micro_batch * o.seq_len;
  return std::min<int64_t>(n, std::max<int64_t>(16, (int64_t{1} << 22) / c.vocab_size));
}

size_t head_scratch_bytes(const LlamaConfig& c, const ModelOptions& o) {
  Arena ar;
  carve(ar, c, o);
  return ar.used();
}

float head_forward(const UnitContext& ctx, const ForwardArgs& a) {
  if (a.params == nullptr || a.input == nullptr)
    throw InvalidArgument("head forward: params and input are required");
  const int64_t N = ctx.tokens(), H = ctx.cfg.hidden_size, V = ctx.cfg.vocab_size;
  if (a.targets != nullptr) check_ids(a.targets, N, ctx.opt.seq_len, V, "target");
  Arena ar(a.scratch.data(), a.scratch.size());
  const HeadWork w = carve(ar, ctx.cfg, ctx.opt);
  const HeadWeight hw = head_weight(ctx, a.params, a.tied_params);
  const float* wn = weight_f32(ctx, a.params, ctx.unit.tensors[0], w.wn);
  kernels::rmsnorm_forward(a.input, wn, static_cast<float>(ctx.cfg.rms_norm_eps), N, H, w.xn,
                           w.rstd);
  const int64_t chunk = head_chunk_rows(ctx.cfg, ctx.opt);
  double loss = 0.0;
  for (int64_t c0 = 0; c0 < N; c0 += chunk) {
    const int64_t rows = std::min(chunk, N - c0);
    float* logits = a.logits != nullptr ? a.logits + c0 * V : w.logits;
    project(ctx, hw, w.xn + c0 * H, rows, logits, w.wtmp);
    if (a.targets == nullptr) continue;
    for (int64_t r = 0; r < rows; ++r) {
      const float* row = logits + r * V;
      loss += kmath::xent_loss(kernels::log_sum_exp(row, V), row[a.targets[c0 + r]]);
    }
  }
  return static_cast<float>(loss / static_cast<double>(N));
}

float head_backward(const UnitContext& ctx, const BackwardArgs& a) {
  if (a.params == nullptr || a.input == nullptr || a.targets == nullptr ||
      a.grad_input == nullptr || a.grads == nullptr)
    throw InvalidArgument(
        "head backward: params, input, targets, grad_input and grads are required");
  const bool tied = ctx.cfg.tie_word_embeddings;
  if (tied && a.tied_grads == nullptr)
    throw InvalidArgument(
        "head backward: tie_word_embeddings needs the embedding unit's gradient slab (tied_grads)");
  const int64_t N = ctx.tokens(), H = ctx.cfg.hidden_size, V = ctx.cfg.vocab_size;
  check_ids(a.targets, N, ctx.opt.seq_len, V, "target");
  Arena ar(a.scratch.data(), a.scratch.size());
  const HeadWork w = carve(ar, ctx.cfg, ctx.opt);
  const HeadWeight hw = head_weight(ctx, a.params, a.tied_params);
  if (a.mode == GradMode::Overwrite) {
    std::memset(a.grads, 0, sizeof(float) * ctx.unit.padded_numel);
    if (tied) std::memset(a.tied_grads, 0, sizeof(float) * ctx.embed.padded_numel);
  }
  float* dW = (tied ? a.tied_grads : a.grads) + hw.spec->offset;

  const float* wn = weight_f32(ctx, a.params, ctx.unit.tensors[0], w.wn);
  kernels::rmsnorm_forward(a.input, wn, static_cast<float>(ctx.cfg.rms_norm_eps), N, H, w.xn,
                           w.rstd);
  const int64_t chunk = head_chunk_rows(ctx.cfg, ctx.opt), vb = vocab_block(ctx.cfg, ctx.opt);
  const float coef = a.loss_scale / static_cast<float>(N);
  double loss = 0.0;
  for (int64_t c0 = 0; c0 < N; c0 += chunk) {
    const int64_t rows = std::min(chunk, N - c0);
    project(ctx, hw, w.xn + c0 * H, rows, w.logits, w.wtmp);
    for (int64_t r = 0; r < rows; ++r) {
      float* row = w.logits + r * V;
      const int32_t t = a.targets[c0 + r];
      const float target_logit = row[t];
      const float lse = kernels::softmax_inplace(row, V);
      loss += kmath::xent_loss(lse, target_logit);
      for (int64_t j = 0; j < V; ++j) row[j] = kmath::xent_scale(row[j], coef);
      row[t] = kmath::xent_target(row[t], coef);
    }
    // dxn = dlogits W; dW += dlogits^T xn, one vocabulary block at a time.
    for (int64_t v0 = 0; v0 < V; v0 += vb) {
      const int64_t n = std::min(vb, V - v0);
      const float* W = weight_f32(ctx, hw.slab, *hw.spec, w.wtmp, v0 * H, n * H);
      gemm(false, false, rows, H, n, 1.0f, w.logits + v0, V, W, H, v0 == 0 ? 0.0f : 1.0f,
           w.dxn + c0 * H, H);
      gemm(true, false, n, H, rows, 1.0f, w.logits + v0, V, w.xn + c0 * H, H, 1.0f, dW + v0 * H, H);
    }
  }
  std::memset(a.grad_input, 0, sizeof(float) * N * H);
  kernels::rmsnorm_backward(w.dxn, a.input, wn, w.rstd, N, H, a.grad_input,
                            a.grads + ctx.unit.tensors[0].offset);
  return static_cast<float>(loss / static_cast<double>(N));
}

}  // namespace outcore::model::detail
