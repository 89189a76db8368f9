// Head unit: final RMSNorm, output projection (lm_head or the tied embedding) and
// cross-entropy, computed chunk by chunk of rows so that all logits never exist at once. The
// per-row losses stay on the device until the micro-batch's last chunk: one copy to the host
// per call, no synchronisation per chunk.
#include <cmath>
#include <cstring>
#include <vector>

#include "engine/model/unit_internal.hpp"

namespace outcore::model::detail {
namespace {

// Vocabulary rows converted to fp32 at once when the head weight is not stored in fp32 (all of
// them when nothing is converted: fp32 weights, or bf16 compute reading the slab).
int64_t vocab_block(const LlamaConfig& c, const ModelOptions& o) {
  if (o.param_dtype == DType::F32 || o.compute_dtype == DType::BF16) return c.vocab_size;
  return std::min<int64_t>(c.vocab_size, std::max<int64_t>(1, (int64_t{1} << 20) / c.hidden_size));
}

// In bf16 compute, xn16 and dlogits16 hold the bf16 GEMM operands (all normalized rows, one
// chunk's logit gradients).
struct HeadWork {
  float *xn, *rstd, *wn, *logits, *wtmp, *dxn, *row_loss;
  void *xn16, *dlogits16;
};

HeadWork carve(Arena& ar, const LlamaConfig& c, const ModelOptions& o) {
  const int64_t n = o.micro_batch * o.seq_len, h = c.hidden_size;
  const bool bf16 = o.compute_dtype == DType::BF16;
  HeadWork w;
  w.xn = ar.floats(n * h);
  w.rstd = ar.floats(n);
  w.wn = ar.floats(h);
  w.logits = ar.floats(head_chunk_rows(c, o) * c.vocab_size);
  w.wtmp = ar.floats(o.param_dtype == DType::F32 || bf16 ? 0 : vocab_block(c, o) * h);
  w.dxn = ar.floats(n * h);
  w.row_loss = ar.floats(n);
  w.xn16 = ar.halves(bf16 ? n * h : 0);
  w.dlogits16 = ar.halves(bf16 ? head_chunk_rows(c, o) * c.vocab_size : 0);
  return w;
}

// The mean of the micro-batch's `n` per-row losses at `dev` (device memory), copied to the host
// once: summed in double, chunk by chunk of `chunk` rows and the chunks' sums in order.
float mean_loss(const UnitContext& ctx, const float* dev, int64_t n, int64_t chunk) {
  std::vector<float> host(static_cast<size_t>(n));
  ctx.be.download(host.data(), dev, sizeof(float) * host.size());
  double loss = 0.0;
  for (int64_t c0 = 0; c0 < n; c0 += chunk) {
    double sum = 0.0;
    for (int64_t r = c0; r < std::min(n, c0 + chunk); ++r) sum += host[r];
    loss += sum;
  }
  return static_cast<float>(loss / static_cast<double>(n));
}

// Like check_ids, but a target < 0 (kIgnoreTarget) is a row not trained on.
void check_targets(const int32_t* ids, int64_t n, int64_t seq, int64_t vocab) {
  for (int64_t i = 0; i < n; ++i) {
    if (ids[i] >= vocab)
      throw InvalidArgument(fmt::format(
          "target id {} at position {} (sequence {}, offset {}) is outside the vocabulary [0, {})",
          ids[i], i, i / seq, i % seq, vocab));
  }
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
void project(const UnitContext& ctx, const HeadWeight& hw, Operand xn, int64_t rows, float* logits,
             float* wtmp) {
  const int64_t V = ctx.cfg.vocab_size, H = ctx.cfg.hidden_size, vb = vocab_block(ctx.cfg, ctx.opt);
  for (int64_t v0 = 0; v0 < V; v0 += vb) {
    const int64_t n = std::min(vb, V - v0);
    const Operand W = weight_operand(ctx, hw.slab, *hw.spec, H, wtmp, v0 * H, n * H);
    matmul(ctx, false, true, rows, n, H, 1.0f, xn, W, 0.0f, logits + v0, V);
  }
}

// The final norm of the head's input as the projection's operand: in bf16 compute rounded by
// the norm kernel itself into w.xn16.
Operand normed_input(const UnitContext& ctx, const float* input, const float* wn,
                     const HeadWork& w) {
  const KernelOperand xn = kernel_operand(ctx, w.xn, w.xn16, ctx.cfg.hidden_size);
  ctx.be.rmsnorm_forward(input, wn, static_cast<float>(ctx.cfg.rms_norm_eps), ctx.tokens(),
                         ctx.cfg.hidden_size, xn.fp32, w.rstd, xn.bf16);
  return xn.op;
}

}  // namespace

int64_t head_chunk_rows(const LlamaConfig& c, const ModelOptions& o) {
  const int64_t n = o.micro_batch * o.seq_len;
  if (o.head_chunk_rows > 0) return std::min(n, o.head_chunk_rows);
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
  const int64_t N = ctx.tokens(), V = ctx.cfg.vocab_size;
  if (a.targets != nullptr) check_targets(a.targets, N, ctx.opt.seq_len, V);
  Arena ar(a.scratch.data(), a.scratch.size());
  const HeadWork w = carve(ar, ctx.cfg, ctx.opt);
  const HeadWeight hw = head_weight(ctx, a.params, a.tied_params);
  const float* wn = weight_f32(ctx, a.params, ctx.unit.tensors[0], w.wn);
  const Operand xn = normed_input(ctx, a.input, wn, w);
  const int64_t chunk = head_chunk_rows(ctx.cfg, ctx.opt);
  const int32_t* targets = a.targets != nullptr ? ctx.be.stage_ids(a.targets, N, 1) : nullptr;
  for (int64_t c0 = 0; c0 < N; c0 += chunk) {
    const int64_t rows = std::min(chunk, N - c0);
    float* logits = a.logits != nullptr ? a.logits + c0 * V : w.logits;
    project(ctx, hw, rows_from(ctx, xn, c0), rows, logits, w.wtmp);
    if (targets != nullptr)
      ctx.be.cross_entropy(logits, targets + c0, rows, V, 0.0f, false, w.row_loss + c0, nullptr);
  }
  return targets != nullptr ? mean_loss(ctx, w.row_loss, N, chunk) : 0.0f;
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
  check_targets(a.targets, N, ctx.opt.seq_len, V);
  Arena ar(a.scratch.data(), a.scratch.size());
  const HeadWork w = carve(ar, ctx.cfg, ctx.opt);
  const HeadWeight hw = head_weight(ctx, a.params, a.tied_params);
  // Overwriting, the first chunk's GEMMs write dW with beta 0; the rest of both slabs is zeroed.
  const bool overwrite = a.mode == GradMode::Overwrite;
  if (overwrite) {
    if (tied) {
      zero_all_but(ctx, ctx.unit, a.grads, {});
      zero_all_but(ctx, ctx.embed, a.tied_grads, {hw.spec});
    } else {
      zero_all_but(ctx, ctx.unit, a.grads, {hw.spec});
    }
  }
  float* dW = (tied ? a.tied_grads : a.grads) + hw.spec->offset;

  const float* wn = weight_f32(ctx, a.params, ctx.unit.tensors[0], w.wn);
  const Operand xn = normed_input(ctx, a.input, wn, w);
  const int64_t chunk = head_chunk_rows(ctx.cfg, ctx.opt), vb = vocab_block(ctx.cfg, ctx.opt);
  const float coef = a.loss_scale / static_cast<float>(N);
  const int32_t* targets = ctx.be.stage_ids(a.targets, N, 1);
  for (int64_t c0 = 0; c0 < N; c0 += chunk) {
    const int64_t rows = std::min(chunk, N - c0);
    const Operand xn_rows = rows_from(ctx, xn, c0);
    project(ctx, hw, xn_rows, rows, w.logits, w.wtmp);
    // dlogits: in bf16 compute rounded by the loss kernel itself (no fp32 pass between them).
    const bool bf16 = bf16_compute(ctx);
    ctx.be.cross_entropy(w.logits, targets + c0, rows, V, coef, true, w.row_loss + c0,
                         bf16 ? w.dlogits16 : nullptr);
    const Operand dlogits{bf16 ? w.dlogits16 : static_cast<const void*>(w.logits), V};
    // dxn = dlogits W; dW += dlogits^T xn, one vocabulary block at a time.
    for (int64_t v0 = 0; v0 < V; v0 += vb) {
      const int64_t n = std::min(vb, V - v0);
      const Operand W = weight_operand(ctx, hw.slab, *hw.spec, H, w.wtmp, v0 * H, n * H);
      const Operand dl = column_from(ctx, dlogits, v0);
      matmul(ctx, false, false, rows, H, n, 1.0f, dl, W, v0 == 0 ? 0.0f : 1.0f, w.dxn + c0 * H, H);
      matmul(ctx, true, false, n, H, rows, 1.0f, dl, xn_rows, overwrite && c0 == 0 ? 0.0f : 1.0f,
             dW + v0 * H, H);
    }
  }
  ctx.be.zero(a.grad_input, sizeof(float) * N * H);
  ctx.be.rmsnorm_backward(w.dxn, a.input, wn, w.rstd, N, H, a.grad_input,
                          a.grads + ctx.unit.tensors[0].offset);
  return mean_loss(ctx, w.row_loss, N, chunk);
}

}  // namespace outcore::model::detail

namespace outcore::model {

int64_t head_rows_on(const LlamaConfig& c, const ModelOptions& o, const device::Device& device,
                     uint64_t budget_bytes) {
  if (device.kind() != device::DeviceKind::Cuda) return 0;
  return head_rows_for_device(c, o, head_sizing_bytes(budget_bytes, device.total_memory_bytes()));
}

uint64_t head_sizing_bytes(uint64_t budget_bytes, uint64_t device_total_bytes) {
  return budget_bytes > 0 ? std::min(budget_bytes, device_total_bytes) : device_total_bytes;
}

int64_t head_rows_for_device(const LlamaConfig& c, const ModelOptions& o, uint64_t device_bytes) {
  const uint64_t bytes = std::min<uint64_t>(device_bytes / 16, uint64_t{2} << 30);
  const uint64_t per_row =
      static_cast<uint64_t>(c.vocab_size) * (o.compute_dtype == DType::BF16 ? 6 : 4);
  const int64_t n = o.micro_batch * o.seq_len;
  return std::min<int64_t>(n, std::max<int64_t>(16, static_cast<int64_t>(bytes / per_row)));
}

}  // namespace outcore::model
