// Decoder layer forward and backward: pre-norm attention with rotary embeddings and grouped
// key/value heads, then a pre-norm SwiGLU MLP, each with a residual connection.
#include <cmath>
#include <cstring>

#include "engine/model/unit_internal.hpp"

namespace outcore::model::detail {
namespace {

// Tensor order in a decoder unit (see make_layout).
enum : int { kInNorm, kQ, kK, kV, kO, kPostNorm, kGate, kUp, kDown };

struct Dims {
  int64_t B, T, N, H, Q, KV, I, nh, nkv, hd, block;
  explicit Dims(const LlamaConfig& c, const ModelOptions& o)
      : B(o.micro_batch),
        T(o.seq_len),
        N(o.micro_batch * o.seq_len),
        H(c.hidden_size),
        Q(c.q_dim()),
        KV(c.kv_dim()),
        I(c.intermediate_size),
        nh(c.num_attention_heads),
        nkv(c.num_key_value_heads),
        hd(c.head_dim),
        block(attention_block(o)) {}
};

// What forward keeps for backward (in `saved`, or in scratch with checkpointing).
struct Saved {
  float *rstd1, *xn1, *q, *k, *v, *lse, *attn, *h, *rstd2, *xn2, *g, *u, *a;
};

Saved carve_saved(Arena& ar, const Dims& d) {
  Saved s;
  s.rstd1 = ar.floats(d.N);
  s.xn1 = ar.floats(d.N * d.H);
  s.q = ar.floats(d.N * d.Q);
  s.k = ar.floats(d.N * d.KV);
  s.v = ar.floats(d.N * d.KV);
  s.lse = ar.floats(d.B * d.nh * d.T);
  s.attn = ar.floats(d.N * d.Q);
  s.h = ar.floats(d.N * d.H);
  s.rstd2 = ar.floats(d.N);
  s.xn2 = ar.floats(d.N * d.H);
  s.g = ar.floats(d.N * d.I);
  s.u = ar.floats(d.N * d.I);
  s.a = ar.floats(d.N * d.I);
  return s;
}

// Working memory of forward (f) and backward (b) beyond Saved.
struct Work {
  float *wtmp, *wn1, *wn2, *scores;                     // forward and backward
  float *dprob, *dxn, *da, *du, *dattn, *dq, *dk, *dv;  // backward only
};

Work carve_work(Arena& ar, const Dims& d, const LlamaConfig& c, const ModelOptions& o,
                bool backward) {
  Work w{};
  w.wtmp = ar.floats(o.param_dtype == DType::F32 ? 0 : max_decoder_weight(c));
  w.wn1 = ar.floats(d.H);
  w.wn2 = ar.floats(d.H);
  w.scores = ar.floats(d.block * d.T);
  if (!backward) return w;
  w.dprob = ar.floats(d.block * d.T);
  w.dxn = ar.floats(d.N * d.H);
  w.da = ar.floats(d.N * d.I);
  w.du = ar.floats(d.N * d.I);
  w.dattn = ar.floats(d.N * d.Q);
  w.dq = ar.floats(d.N * d.Q);
  w.dk = ar.floats(d.N * d.KV);
  w.dv = ar.floats(d.N * d.KV);
  return w;
}

const TensorSpec& tensor(const UnitContext& ctx, int i) { return ctx.unit.tensors[i]; }

// Copies a norm weight to fp32 in `dst` (norm weights are used while wtmp holds a matrix).
const float* norm_weight(const UnitContext& ctx, const void* params, int i, float* dst) {
  const float* w = weight_f32(ctx, params, tensor(ctx, i), dst);
  return w;
}

device::ComputeBackend::Attention attention_of(const Dims& d) {
  return {.B = d.B,
          .T = d.T,
          .nh = d.nh,
          .nkv = d.nkv,
          .hd = d.hd,
          .block = d.block,
          .scale = 1.0f / std::sqrt(static_cast<float>(d.hd))};
}

// The forward proper. Writes Saved; writes the layer output to `out` when non-null.
void forward_into(const UnitContext& ctx, const void* params, const float* x, float* out,
                  const Saved& s, const Work& w) {
  device::ComputeBackend& be = ctx.be;
  const Dims d(ctx.cfg, ctx.opt);
  const float eps = static_cast<float>(ctx.cfg.rms_norm_eps);
  const float* wn1 = norm_weight(ctx, params, kInNorm, w.wn1);
  be.rmsnorm_forward(x, wn1, eps, d.N, d.H, s.xn1, s.rstd1);
  const float* W = weight_f32(ctx, params, tensor(ctx, kQ), w.wtmp);
  be.gemm(false, true, d.N, d.Q, d.H, 1.0f, s.xn1, d.H, W, d.H, 0.0f, s.q, d.Q);
  W = weight_f32(ctx, params, tensor(ctx, kK), w.wtmp);
  be.gemm(false, true, d.N, d.KV, d.H, 1.0f, s.xn1, d.H, W, d.H, 0.0f, s.k, d.KV);
  W = weight_f32(ctx, params, tensor(ctx, kV), w.wtmp);
  be.gemm(false, true, d.N, d.KV, d.H, 1.0f, s.xn1, d.H, W, d.H, 0.0f, s.v, d.KV);
  be.rope(s.q, d.N, d.T, d.nh, d.hd, ctx.rope_cos, ctx.rope_sin, false);
  be.rope(s.k, d.N, d.T, d.nkv, d.hd, ctx.rope_cos, ctx.rope_sin, false);
  be.attention_forward(attention_of(d), s.q, s.k, s.v, s.lse, s.attn, w.scores);

  be.copy(s.h, x, sizeof(float) * d.N * d.H);
  W = weight_f32(ctx, params, tensor(ctx, kO), w.wtmp);
  be.gemm(false, true, d.N, d.H, d.Q, 1.0f, s.attn, d.Q, W, d.Q, 1.0f, s.h, d.H);

  const float* wn2 = norm_weight(ctx, params, kPostNorm, w.wn2);
  be.rmsnorm_forward(s.h, wn2, eps, d.N, d.H, s.xn2, s.rstd2);
  W = weight_f32(ctx, params, tensor(ctx, kGate), w.wtmp);
  be.gemm(false, true, d.N, d.I, d.H, 1.0f, s.xn2, d.H, W, d.H, 0.0f, s.g, d.I);
  W = weight_f32(ctx, params, tensor(ctx, kUp), w.wtmp);
  be.gemm(false, true, d.N, d.I, d.H, 1.0f, s.xn2, d.H, W, d.H, 0.0f, s.u, d.I);
  be.swiglu_forward(s.g, s.u, s.a, d.N * d.I);
  if (out == nullptr) return;  // recomputation for backward needs no output
  be.copy(out, s.h, sizeof(float) * d.N * d.H);
  W = weight_f32(ctx, params, tensor(ctx, kDown), w.wtmp);
  be.gemm(false, true, d.N, d.H, d.I, 1.0f, s.a, d.I, W, d.I, 1.0f, out, d.H);
}

}  // namespace

size_t decoder_saved_bytes(const LlamaConfig& c, const ModelOptions& o) {
  Arena ar;
  carve_saved(ar, Dims(c, o));
  return ar.used();
}

size_t decoder_scratch_bytes(const LlamaConfig& c, const ModelOptions& o) {
  const Dims d(c, o);
  Arena saved;
  if (o.activation_checkpointing) carve_saved(saved, d);
  size_t most = 0;
  for (bool backward : {false, true}) {
    Arena ar;
    ar.floats(static_cast<int64_t>((saved.used() + 3) / 4));
    carve_work(ar, d, c, o, backward);
    most = std::max(most, ar.used());
  }
  return most;
}

void decoder_forward(const UnitContext& ctx, const ForwardArgs& a) {
  if (a.params == nullptr || a.input == nullptr || a.output == nullptr)
    throw InvalidArgument(
        fmt::format("{} forward: params, input and output are required", ctx.unit.name));
  const Dims d(ctx.cfg, ctx.opt);
  Arena scratch(a.scratch.data(), a.scratch.size());
  Saved s;
  if (ctx.opt.activation_checkpointing) {
    s = carve_saved(scratch, d);
  } else {
    Arena saved(a.saved.data(), a.saved.size());
    if (a.saved.data() == nullptr)
      throw InvalidArgument(fmt::format("{} forward: no saved-activation buffer", ctx.unit.name));
    s = carve_saved(saved, d);
  }
  const Work w = carve_work(scratch, d, ctx.cfg, ctx.opt, false);
  forward_into(ctx, a.params, a.input, a.output, s, w);
}

void decoder_backward(const UnitContext& ctx, const BackwardArgs& a) {
  if (a.params == nullptr || a.input == nullptr || a.grad_output == nullptr ||
      a.grad_input == nullptr || a.grads == nullptr)
    throw InvalidArgument(
        fmt::format("{} backward: params, input, grad_output, grad_input and grads are required",
                    ctx.unit.name));
  const Dims d(ctx.cfg, ctx.opt);
  Arena scratch(a.scratch.data(), a.scratch.size());
  Saved s;
  if (ctx.opt.activation_checkpointing) {
    s = carve_saved(scratch, d);
  } else {
    if (a.saved.data() == nullptr)
      throw InvalidArgument(fmt::format("{} backward: no saved-activation buffer", ctx.unit.name));
    Arena saved(const_cast<std::byte*>(a.saved.data()), a.saved.size());
    s = carve_saved(saved, d);
  }
  const Work w = carve_work(scratch, d, ctx.cfg, ctx.opt, true);
  if (ctx.opt.activation_checkpointing) forward_into(ctx, a.params, a.input, nullptr, s, w);

  device::ComputeBackend& be = ctx.be;
  float* dh = a.grad_input;
  if (a.grad_input != a.grad_output) be.copy(dh, a.grad_output, sizeof(float) * d.N * d.H);
  if (a.mode == GradMode::Overwrite) be.zero(a.grads, sizeof(float) * ctx.unit.padded_numel);
  auto G = [&](int i) { return a.grads + tensor(ctx, i).offset; };
  const float* W;

  // MLP: out = h + down(silu(gate(xn2)) * up(xn2))
  W = weight_f32(ctx, a.params, tensor(ctx, kDown), w.wtmp);
  be.gemm(false, false, d.N, d.I, d.H, 1.0f, dh, d.H, W, d.I, 0.0f, w.da, d.I);
  be.gemm(true, false, d.H, d.I, d.N, 1.0f, dh, d.H, s.a, d.I, 1.0f, G(kDown), d.I);
  float* dg = w.da;
  be.swiglu_backward(w.da, s.g, s.u, dg, w.du, d.N * d.I);
  W = weight_f32(ctx, a.params, tensor(ctx, kGate), w.wtmp);
  be.gemm(false, false, d.N, d.H, d.I, 1.0f, dg, d.I, W, d.H, 0.0f, w.dxn, d.H);
  W = weight_f32(ctx, a.params, tensor(ctx, kUp), w.wtmp);
  be.gemm(false, false, d.N, d.H, d.I, 1.0f, w.du, d.I, W, d.H, 1.0f, w.dxn, d.H);
  be.gemm(true, false, d.I, d.H, d.N, 1.0f, dg, d.I, s.xn2, d.H, 1.0f, G(kGate), d.H);
  be.gemm(true, false, d.I, d.H, d.N, 1.0f, w.du, d.I, s.xn2, d.H, 1.0f, G(kUp), d.H);
  const float* wn2 = norm_weight(ctx, a.params, kPostNorm, w.wn2);
  be.rmsnorm_backward(w.dxn, s.h, wn2, s.rstd2, d.N, d.H, dh, G(kPostNorm));

  // Attention: h = x + o(attn(rope(q(xn1)), rope(k(xn1)), v(xn1)))
  W = weight_f32(ctx, a.params, tensor(ctx, kO), w.wtmp);
  be.gemm(false, false, d.N, d.Q, d.H, 1.0f, dh, d.H, W, d.Q, 0.0f, w.dattn, d.Q);
  be.gemm(true, false, d.H, d.Q, d.N, 1.0f, dh, d.H, s.attn, d.Q, 1.0f, G(kO), d.Q);
  be.zero(w.dk, sizeof(float) * d.N * d.KV);
  be.zero(w.dv, sizeof(float) * d.N * d.KV);
  be.attention_backward(attention_of(d), s.q, s.k, s.v, s.lse, w.dattn, w.dq, w.dk, w.dv, w.scores,
                        w.dprob);
  be.rope(w.dq, d.N, d.T, d.nh, d.hd, ctx.rope_cos, ctx.rope_sin, true);
  be.rope(w.dk, d.N, d.T, d.nkv, d.hd, ctx.rope_cos, ctx.rope_sin, true);
  W = weight_f32(ctx, a.params, tensor(ctx, kQ), w.wtmp);
  be.gemm(false, false, d.N, d.H, d.Q, 1.0f, w.dq, d.Q, W, d.H, 0.0f, w.dxn, d.H);
  W = weight_f32(ctx, a.params, tensor(ctx, kK), w.wtmp);
  be.gemm(false, false, d.N, d.H, d.KV, 1.0f, w.dk, d.KV, W, d.H, 1.0f, w.dxn, d.H);
  W = weight_f32(ctx, a.params, tensor(ctx, kV), w.wtmp);
  be.gemm(false, false, d.N, d.H, d.KV, 1.0f, w.dv, d.KV, W, d.H, 1.0f, w.dxn, d.H);
  be.gemm(true, false, d.Q, d.H, d.N, 1.0f, w.dq, d.Q, s.xn1, d.H, 1.0f, G(kQ), d.H);
  be.gemm(true, false, d.KV, d.H, d.N, 1.0f, w.dk, d.KV, s.xn1, d.H, 1.0f, G(kK), d.H);
  be.gemm(true, false, d.KV, d.H, d.N, 1.0f, w.dv, d.KV, s.xn1, d.H, 1.0f, G(kV), d.H);
  const float* wn1 = norm_weight(ctx, a.params, kInNorm, w.wn1);
  be.rmsnorm_backward(w.dxn, a.input, wn1, s.rstd1, d.N, d.H, dh, G(kInNorm));
}

}  // namespace outcore::model::detail
