// Decoder layer forward and backward: pre-norm attention with rotary embeddings and grouped
// key/value heads, then a pre-norm SwiGLU MLP, each with a residual connection.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "engine/model/unit_internal.hpp"

namespace outcore::model::detail {
namespace {

// Tensor order in a decoder unit (see make_layout).
// Then Qwen3's q_norm, k_norm, or Qwen2's q, k and v biases.
enum : int { kInNorm, kQ, kK, kV, kO, kPostNorm, kGate, kUp, kDown, kQNorm = 9, kKNorm = 10 };
enum : int { kQBias = 9, kKBias = 10, kVBias = 11 };

struct Dims {
  int64_t B, T, N, H, Q, KV, I, nh, nkv, hd, block;
  bool qk_norm;   // Qwen3: q and k normalised per head before RoPE
  bool qkv_bias;  // Qwen2: biases on the q, k and v projections
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
        block(attention_block(o)),
        qk_norm(c.qk_norm()),
        qkv_bias(c.qkv_bias()) {}
};

// What forward keeps for backward (in `saved`, or in scratch with checkpointing).
// With qk_norm, q_raw / k_raw are the projections before the per-head norm and rstd_q / rstd_k
// its statistics (one per head row); q and k are always what attention reads (after RoPE).
// The activations that only GEMMs (and attention) read, xn1 q k v attn xn2 a, are kept as the
// GEMMs take them: fp32 in fp32 compute, rounded to bf16 once in bf16 compute (half the bytes,
// and backward reads them without rounding them again). The rest stay fp32: h, g and u feed
// RMSNorm's and SwiGLU's backward, which compute in fp32.
struct Saved {
  float *rstd1, *lse, *h, *rstd2, *g, *u;
  void *xn1, *q, *k, *v, *attn, *xn2, *a;  // in the compute dtype
  float *q_raw, *k_raw, *rstd_q, *rstd_k;
};

Saved carve_saved(Arena& ar, const Dims& d, DType compute) {
  auto operand = [&](int64_t n) -> void* {
    return compute == DType::BF16 ? ar.halves(n) : static_cast<void*>(ar.floats(n));
  };
  Saved s;
  s.rstd1 = ar.floats(d.N);
  s.xn1 = operand(d.N * d.H);
  s.q = operand(d.N * d.Q);
  s.k = operand(d.N * d.KV);
  s.v = operand(d.N * d.KV);
  s.lse = ar.floats(d.B * d.nh * d.T);
  s.attn = operand(d.N * d.Q);
  s.h = ar.floats(d.N * d.H);
  s.rstd2 = ar.floats(d.N);
  s.xn2 = operand(d.N * d.H);
  s.g = ar.floats(d.N * d.I);
  s.u = ar.floats(d.N * d.I);
  s.a = operand(d.N * d.I);
  s.q_raw = ar.floats(d.qk_norm ? d.N * d.Q : 0);
  s.k_raw = ar.floats(d.qk_norm ? d.N * d.KV : 0);
  s.rstd_q = ar.floats(d.qk_norm ? d.N * d.nh : 0);
  s.rstd_k = ar.floats(d.qk_norm ? d.N * d.nkv : 0);
  return s;
}

// y[N, cols] += the bias tensor `i` on every row: the rank-1 GEMM ones[N] x bias[cols], fp32
// (the bias widened exactly from the slab), so each element gains the bias exactly.
void add_bias(const UnitContext& ctx, const void* params, int i, const Dims& d, int64_t cols,
              float* y, float* tmp) {
  const float* b = weight_f32(ctx, params, ctx.unit.tensors[i], tmp);
  ctx.be.gemm(false, false, d.N, cols, 1, 1.0f, ctx.ones, 1, b, cols, 1.0f, y, cols);
}

// db[cols] += the sum over rows of dy[N, cols]: dy^T ones, fp32.
void bias_grad(const UnitContext& ctx, const Dims& d, int64_t cols, const float* dy, float* db) {
  ctx.be.gemm(true, false, cols, 1, d.N, 1.0f, dy, cols, ctx.ones, 1, 1.0f, db, 1);
}

device::ComputeBackend::Attention attention_of(const Dims& d, const ModelOptions& o) {
  return {.B = d.B,
          .T = d.T,
          .nh = d.nh,
          .nkv = d.nkv,
          .hd = d.hd,
          .block = d.block,
          .scale = 1.0f / std::sqrt(static_cast<float>(d.hd)),
          .dtype = o.compute_dtype};
}

// Working memory of forward (f) and backward (b) beyond Saved. In bf16 compute: `act` holds one
// fp32 activation at a time (up to N x max(H, Q, I)) on its way to its bf16 copy in Saved (in
// backward it is da's memory, free while checkpointing recomputes the forward); h1 and h2 hold
// gradients rounded to bf16 as GEMM operands (up to N x max(H, Q, I, 2 KV) elements; dattn's in
// h1); lowp is attention's bf16 scratch.
struct Work {
  float *wtmp, *wn1, *wn2, *scores;                     // forward and backward
  float *wqn, *wkn;                                     // qk_norm weights in fp32
  float* wbias;                                         // qkv_bias: one bias in fp32
  float* act;                                           // bf16 compute only
  float *dq_raw, *dk_raw;                               // qk_norm, backward only
  float *dprob, *dxn, *da, *du, *dattn, *dq, *dk, *dv;  // backward only
  void *h1, *h2, *lowp;                                 // bf16 compute only
};

Work carve_work(Arena& ar, const Dims& d, const LlamaConfig& c, const ModelOptions& o,
                bool backward) {
  const bool bf16 = o.compute_dtype == DType::BF16;
  Work w{};
  w.wtmp = ar.floats(o.param_dtype == DType::F32 || bf16 ? 0 : max_decoder_weight(c));
  w.wn1 = ar.floats(d.H);
  w.wn2 = ar.floats(d.H);
  w.scores = ar.floats(d.block * d.T);
  w.wqn = ar.floats(d.qk_norm ? d.hd : 0);
  w.wkn = ar.floats(d.qk_norm ? d.hd : 0);
  w.wbias = ar.floats(d.qkv_bias ? std::max(d.Q, d.KV) : 0);
  w.lowp = ar.halves(device::ComputeBackend::attention_bf16_scratch(attention_of(d, o)));
  const int64_t activation = bf16 ? d.N * std::max({d.H, d.Q, d.I}) : 0;
  if (!backward) {
    w.act = ar.floats(activation);
    return w;
  }
  const int64_t halves = bf16 ? d.N * std::max({d.H, d.Q, d.I, 2 * d.KV}) : 0;
  w.h1 = ar.halves(halves);
  w.h2 = ar.halves(halves);
  w.dprob = ar.floats(d.block * d.T);
  w.dxn = ar.floats(d.N * d.H);
  w.da = ar.floats(std::max(d.N * d.I, activation));
  w.act = bf16 ? w.da : nullptr;
  w.du = ar.floats(d.N * d.I);
  w.dattn = ar.floats(d.N * d.Q);
  w.dq = ar.floats(d.N * d.Q);
  w.dk = ar.floats(d.N * d.KV);
  w.dv = ar.floats(d.N * d.KV);
  w.dq_raw = ar.floats(d.qk_norm ? d.N * d.Q : 0);
  w.dk_raw = ar.floats(d.qk_norm ? d.N * d.KV : 0);
  return w;
}

const TensorSpec& tensor(const UnitContext& ctx, int i) { return ctx.unit.tensors[i]; }

// Copies a norm weight to fp32 in `dst` (norm weights are used while wtmp holds a matrix).
const float* norm_weight(const UnitContext& ctx, const void* params, int i, float* dst) {
  const float* w = weight_f32(ctx, params, tensor(ctx, i), dst);
  return w;
}

// Where forward writes the fp32 value of the Saved operand `saved`: `saved` itself in fp32
// compute, Work::act in bf16 compute, whence make_operand rounds it into `saved` (in fp32
// compute make_operand returns it as it is).
float* fp32_of(const UnitContext& ctx, void* saved, const Work& w) {
  return bf16_compute(ctx) ? w.act : static_cast<float*>(saved);
}

// The forward proper. Writes Saved; writes the layer output to `out` when non-null.
void forward_into(const UnitContext& ctx, const void* params, const float* x, float* out,
                  const Saved& s, const Work& w) {
  device::ComputeBackend& be = ctx.be;
  const Dims d(ctx.cfg, ctx.opt);
  const float eps = static_cast<float>(ctx.cfg.rms_norm_eps);
  auto W = [&](int i, int64_t ld) {
    return weight_operand(ctx, params, tensor(ctx, i), ld, w.wtmp);
  };
  // Saved in the compute dtype: one buffer either way.
  auto saved_operand = [&](void* saved, int64_t ld) {
    return kernel_operand(ctx, static_cast<float*>(saved), saved, ld);
  };
  const KernelOperand xn = saved_operand(s.xn1, d.H);
  be.rmsnorm_forward(x, norm_weight(ctx, params, kInNorm, w.wn1), eps, d.N, d.H, xn.fp32, s.rstd1,
                     xn.bf16);
  // q and k: projection (+ bias), per-head norm (qk_norm), RoPE, kept; v: projection (+ bias),
  // kept.
  struct Projection {
    int weight, bias, norm;
    int64_t cols, heads;
    float *raw, *rstd, *wnorm;
    void* saved;
  };
  const Projection projections[] = {
      {kQ, kQBias, kQNorm, d.Q, d.nh, s.q_raw, s.rstd_q, w.wqn, s.q},
      {kK, kKBias, kKNorm, d.KV, d.nkv, s.k_raw, s.rstd_k, w.wkn, s.k},
      {kV, kVBias, -1, d.KV, d.nkv, nullptr, nullptr, nullptr, s.v}};
  for (const Projection& p : projections) {
    float* t = fp32_of(ctx, p.saved, w);
    const bool normed = d.qk_norm && p.norm >= 0;
    float* proj = normed ? p.raw : t;
    matmul(ctx, false, true, d.N, p.cols, d.H, 1.0f, xn.op, W(p.weight, d.H), 0.0f, proj, p.cols);
    if (d.qkv_bias) add_bias(ctx, params, p.bias, d, p.cols, proj, w.wbias);
    if (normed)  // RMSNorm over each head's hd values, before RoPE
      be.rmsnorm_forward(p.raw, norm_weight(ctx, params, p.norm, p.wnorm), eps, d.N * p.heads, d.hd,
                         t, p.rstd, nullptr);
    if (p.norm >= 0)  // RoPE rounds the operand itself
      be.rope(t, d.N, d.T, p.heads, d.hd, ctx.rope_cos, ctx.rope_sin, false,
              kernel_operand(ctx, t, p.saved, p.cols).bf16);
    else
      make_operand(ctx, t, d.N, p.cols, p.saved);
  }
  // In bf16 compute attention rounds its output itself; w.act is its fp32 scratch.
  float* attn = fp32_of(ctx, s.attn, w);
  const KernelOperand attn_out = kernel_operand(ctx, attn, s.attn, d.Q);
  be.attention_forward(attention_of(d, ctx.opt), s.q, s.k, s.v, s.lse, attn, w.scores, w.lowp,
                       attn_out.bf16);
  const Operand attn_op = attn_out.op;

  be.copy(s.h, x, sizeof(float) * d.N * d.H);
  matmul(ctx, false, true, d.N, d.H, d.Q, 1.0f, attn_op, W(kO, d.Q), 1.0f, s.h, d.H);

  const KernelOperand xn2 = saved_operand(s.xn2, d.H);
  be.rmsnorm_forward(s.h, norm_weight(ctx, params, kPostNorm, w.wn2), eps, d.N, d.H, xn2.fp32,
                     s.rstd2, xn2.bf16);
  matmul(ctx, false, true, d.N, d.I, d.H, 1.0f, xn2.op, W(kGate, d.H), 0.0f, s.g, d.I);
  matmul(ctx, false, true, d.N, d.I, d.H, 1.0f, xn2.op, W(kUp, d.H), 0.0f, s.u, d.I);
  const KernelOperand a = saved_operand(s.a, d.I);
  be.swiglu_forward(s.g, s.u, a.fp32, d.N * d.I, a.bf16);
  if (out == nullptr) return;  // recomputation for backward needs no output
  be.copy(out, s.h, sizeof(float) * d.N * d.H);
  matmul(ctx, false, true, d.N, d.H, d.I, 1.0f, a.op, W(kDown, d.I), 1.0f, out, d.H);
}

}  // namespace

device::ComputeBackend::Attention decoder_attention(const LlamaConfig& c, const ModelOptions& o) {
  return attention_of(Dims(c, o), o);
}

size_t decoder_saved_bytes(const LlamaConfig& c, const ModelOptions& o) {
  Arena ar;
  carve_saved(ar, Dims(c, o), o.compute_dtype);
  return ar.used();
}

size_t decoder_scratch_bytes(const LlamaConfig& c, const ModelOptions& o) {
  const Dims d(c, o);
  Arena saved;
  if (o.activation_checkpointing) carve_saved(saved, d, o.compute_dtype);
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
    s = carve_saved(scratch, d, ctx.opt.compute_dtype);
  } else {
    Arena saved(a.saved.data(), a.saved.size());
    if (a.saved.data() == nullptr)
      throw InvalidArgument(fmt::format("{} forward: no saved-activation buffer", ctx.unit.name));
    s = carve_saved(saved, d, ctx.opt.compute_dtype);
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
    s = carve_saved(scratch, d, ctx.opt.compute_dtype);
  } else {
    if (a.saved.data() == nullptr)
      throw InvalidArgument(fmt::format("{} backward: no saved-activation buffer", ctx.unit.name));
    Arena saved(const_cast<std::byte*>(a.saved.data()), a.saved.size());
    s = carve_saved(saved, d, ctx.opt.compute_dtype);
  }
  const Work w = carve_work(scratch, d, ctx.cfg, ctx.opt, true);
  if (ctx.opt.activation_checkpointing) forward_into(ctx, a.params, a.input, nullptr, s, w);

  device::ComputeBackend& be = ctx.be;
  float* dh = a.grad_input;
  if (a.grad_input != a.grad_output) be.copy(dh, a.grad_output, sizeof(float) * d.N * d.H);
  // The weight gradients' GEMMs overwrite (beta 0) or add into their tensors; the rest of the
  // slab is zeroed first when overwriting.
  const bool overwrite = a.mode == GradMode::Overwrite;
  const float gb = overwrite ? 0.0f : 1.0f;
  if (overwrite)
    zero_all_but(ctx, ctx.unit, a.grads,
                 {&tensor(ctx, kQ), &tensor(ctx, kK), &tensor(ctx, kV), &tensor(ctx, kO),
                  &tensor(ctx, kGate), &tensor(ctx, kUp), &tensor(ctx, kDown)});
  auto G = [&](int i) { return a.grads + tensor(ctx, i).offset; };
  auto W = [&](int i, int64_t ld) {
    return weight_operand(ctx, a.params, tensor(ctx, i), ld, w.wtmp);
  };
  auto op = [&](const float* x, int64_t cols, void* half) {
    return make_operand(ctx, x, d.N, cols, half);
  };
  auto saved = [](void* p, int64_t cols) { return Operand{p, cols}; };  // kept by forward

  // MLP: out = h + down(silu(gate(xn2)) * up(xn2))
  Operand dy = op(dh, d.H, w.h1);
  matmul(ctx, false, false, d.N, d.I, d.H, 1.0f, dy, W(kDown, d.I), 0.0f, w.da, d.I);
  matmul(ctx, true, false, d.H, d.I, d.N, 1.0f, dy, saved(s.a, d.I), gb, G(kDown), d.I);
  // dg over da in fp32 compute; in bf16 both straight into their operands
  const KernelOperand dg = kernel_operand(ctx, w.da, w.h1, d.I);
  const KernelOperand du = kernel_operand(ctx, w.du, w.h2, d.I);
  be.swiglu_backward(w.da, s.g, s.u, dg.fp32, du.fp32, d.N * d.I, dg.bf16, du.bf16);
  matmul(ctx, false, false, d.N, d.H, d.I, 1.0f, dg.op, W(kGate, d.H), 0.0f, w.dxn, d.H);
  matmul(ctx, false, false, d.N, d.H, d.I, 1.0f, du.op, W(kUp, d.H), 1.0f, w.dxn, d.H);
  const Operand xn2 = saved(s.xn2, d.H);
  matmul(ctx, true, false, d.I, d.H, d.N, 1.0f, dg.op, xn2, gb, G(kGate), d.H);
  matmul(ctx, true, false, d.I, d.H, d.N, 1.0f, du.op, xn2, gb, G(kUp), d.H);
  const float* wn2 = norm_weight(ctx, a.params, kPostNorm, w.wn2);
  be.rmsnorm_backward(w.dxn, s.h, wn2, s.rstd2, d.N, d.H, dh, G(kPostNorm));

  // Attention: h = x + o(attn(rope(q(xn1)), rope(k(xn1)), v(xn1)))
  dy = op(dh, d.H, w.h1);
  matmul(ctx, false, false, d.N, d.Q, d.H, 1.0f, dy, W(kO, d.Q), 0.0f, w.dattn, d.Q);
  matmul(ctx, true, false, d.H, d.Q, d.N, 1.0f, dy, saved(s.attn, d.Q), gb, G(kO), d.Q);
  be.zero(w.dk, sizeof(float) * d.N * d.KV);
  be.zero(w.dv, sizeof(float) * d.N * d.KV);
  be.attention_backward(attention_of(d, ctx.opt), s.q, s.k, s.v, s.lse, s.attn,
                        op(w.dattn, d.Q, w.h1).p, w.dq, w.dk, w.dv, w.scores, w.dprob, w.lowp);
  // Without qk_norm, RoPE's inverse gives the projections' output gradients: in bf16 compute it
  // rounds their GEMM operands itself (into h1 and h2, which dattn's operand no longer needs).
  const bool rope_rounds = bf16_compute(ctx) && !d.qk_norm;
  be.rope(w.dq, d.N, d.T, d.nh, d.hd, ctx.rope_cos, ctx.rope_sin, true,
          rope_rounds ? w.h1 : nullptr);
  be.rope(w.dk, d.N, d.T, d.nkv, d.hd, ctx.rope_cos, ctx.rope_sin, true,
          rope_rounds ? w.h2 : nullptr);
  float* dq_proj = w.dq;  // the gradient of the q projection's output
  float* dk_proj = w.dk;
  if (d.qk_norm) {  // through the per-head RMSNorm
    be.zero(w.dq_raw, sizeof(float) * d.N * d.Q);
    be.zero(w.dk_raw, sizeof(float) * d.N * d.KV);
    be.rmsnorm_backward(w.dq, s.q_raw, norm_weight(ctx, a.params, kQNorm, w.wqn), s.rstd_q,
                        d.N * d.nh, d.hd, w.dq_raw, G(kQNorm));
    be.rmsnorm_backward(w.dk, s.k_raw, norm_weight(ctx, a.params, kKNorm, w.wkn), s.rstd_k,
                        d.N * d.nkv, d.hd, w.dk_raw, G(kKNorm));
    dq_proj = w.dq_raw;
    dk_proj = w.dk_raw;
  }
  if (d.qkv_bias) {
    bias_grad(ctx, d, d.Q, dq_proj, G(kQBias));
    bias_grad(ctx, d, d.KV, dk_proj, G(kKBias));
    bias_grad(ctx, d, d.KV, w.dv, G(kVBias));
  }
  const Operand dq = rope_rounds ? Operand{w.h1, d.Q} : op(dq_proj, d.Q, w.h1);
  const Operand dk = rope_rounds ? Operand{w.h2, d.KV} : op(dk_proj, d.KV, w.h2);
  void* dv_half = bf16_compute(ctx) ? static_cast<uint16_t*>(w.h2) + d.N * d.KV : nullptr;
  const Operand dv = op(w.dv, d.KV, dv_half);
  matmul(ctx, false, false, d.N, d.H, d.Q, 1.0f, dq, W(kQ, d.H), 0.0f, w.dxn, d.H);
  matmul(ctx, false, false, d.N, d.H, d.KV, 1.0f, dk, W(kK, d.H), 1.0f, w.dxn, d.H);
  matmul(ctx, false, false, d.N, d.H, d.KV, 1.0f, dv, W(kV, d.H), 1.0f, w.dxn, d.H);
  const Operand xn1 = saved(s.xn1, d.H);
  matmul(ctx, true, false, d.Q, d.H, d.N, 1.0f, dq, xn1, gb, G(kQ), d.H);
  matmul(ctx, true, false, d.KV, d.H, d.N, 1.0f, dk, xn1, gb, G(kK), d.H);
  matmul(ctx, true, false, d.KV, d.H, d.N, 1.0f, dv, xn1, gb, G(kV), d.H);
  const float* wn1 = norm_weight(ctx, a.params, kInNorm, w.wn1);
  be.rmsnorm_backward(w.dxn, a.input, wn1, s.rstd1, d.N, d.H, dh, G(kInNorm));
}

}  // namespace outcore::model::detail
