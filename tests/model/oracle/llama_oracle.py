#!/usr/bin/python3
"""Independent float64 PyTorch reference for outcore's Llama model (tests/model).

Usage: llama_oracle.py CASE_DIR [CASE_DIR ...]

Each CASE_DIR holds what the C++ test wrote:
  config.json   Hugging Face Llama config
  case.json     {"batch": B, "seq": T, "loss_scale": s, "compute": "fp32" or "bf16",
                 "tensors": [{"name": ..., "shape": [...]}, ...]}   (order of params.bin)
  params.bin    float32 tensors, concatenated in case.json order
  tokens.bin    int32 [B*T] input ids
  targets.bin   int32 [B*T] next-token ids; -1 = not trained on (a loss mask)
and receives
  result.bin    float64: logits [B*T, vocab], loss (1 value), then the gradient of
                loss_scale * loss for every tensor, in case.json order;
  result_fp32.bin  (compute "bf16" only) the same without the bf16 rounding.

With "compute": "bf16" every matrix product takes its operands rounded to bf16 (nearest even)
in its forward and in both of its backward products, as outcore's bf16 compute dtype and
PyTorch autocast do; attention rounds as a FlashAttention kernel does: its probabilities before
the product with v, the score gradients before the products with k and q, and each row's
sum(p dp) taken as the dot of the output gradient and the output rounded to bf16. Everything
else stays float64.

The architecture is written from the Hugging Face Llama definition (RMSNorm, rotate-half
RoPE, grouped-query causal attention, SwiGLU MLP, mean cross-entropy), not from outcore's code;
with model_type "qwen3", Qwen3's RMSNorm over each head of q and k before RoPE; with
model_type "qwen2", Qwen2's biases on the q, k and v projections.
config.json's rope_scaling ("linear" or "llama3", type in "rope_type" or "type") rescales the
rotary frequencies as the Hugging Face definition does; any other type is an error here.
"""
import json
import math
import os
import sys

import torch

torch.set_default_dtype(torch.float64)


def bf16(x):
    """x rounded to bf16 (nearest even, through fp32 as outcore's fp32 values are)."""
    return x.float().bfloat16().double()


class Bf16MatMul(torch.autograd.Function):
    """alpha * (bf16(a) @ bf16(b)); the backward products round their operands too."""

    @staticmethod
    def forward(ctx, a, b, alpha):
        ctx.save_for_backward(a, b)
        ctx.alpha = alpha
        return alpha * (bf16(a) @ bf16(b))

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        ga = ctx.alpha * (bf16(g) @ bf16(b).transpose(-1, -2))
        gb = ctx.alpha * (bf16(a).transpose(-1, -2) @ bf16(g))
        return ga, gb, None


MATMUL = {"fp32": lambda a, b, alpha=1.0: alpha * (a @ b),
          "bf16": lambda a, b, alpha=1.0: Bf16MatMul.apply(a, b, alpha)}
mm = MATMUL["fp32"]


def causal_mask(T):
    return torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)


def attention_fp32(q, k, v, scale):
    """softmax(scale q k^T, causal) v per head; q, k, v [B, heads, T, hd]."""
    scores = (scale * (q @ k.transpose(-1, -2))).masked_fill(causal_mask(q.shape[-2]),
                                                             float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


LOG2E, LN2 = 1.4426950408889634, 0.6931471805599453


class Bf16Attention(torch.autograd.Function):
    """attention_fp32 at a FlashAttention kernel's rounding points: q, k and v rounded to bf16;
    forward rounds the softmax's numerators exp(s - m) to bf16, m being the row's max rounded up
    to a multiple of ln 2, and divides their product with v by the row's sum; backward rounds the
    probabilities, the output gradient and the score gradients to bf16 where a product reads
    them, and takes each row's sum(p dp) as the dot of the output gradient and the output rounded
    to bf16 (the output is kept in bf16 for backward)."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        scores = (scale * (bf16(q) @ bf16(k).transpose(-1, -2))).masked_fill(
            causal_mask(q.shape[-2]), float("-inf"))
        p = torch.softmax(scores, dim=-1)
        shift = torch.ceil(scores.amax(-1, keepdim=True) * LOG2E) * LN2
        num = torch.exp(scores - shift)
        out = (bf16(num) @ bf16(v)) / num.sum(-1, keepdim=True)
        ctx.save_for_backward(q, k, v, p, out)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, p, out = ctx.saved_tensors
        g = bf16(g)
        dp = g @ bf16(v).transpose(-1, -2)
        d = (g * bf16(out)).sum(-1, keepdim=True)
        ds = bf16(p * (dp - d))
        dq = ctx.scale * (ds @ bf16(k))
        dk = ctx.scale * (ds.transpose(-1, -2) @ bf16(q))
        dv = bf16(p).transpose(-1, -2) @ g
        return dq, dk, dv, None


ATTENTION = {"fp32": attention_fp32,
             "bf16": lambda q, k, v, scale: Bf16Attention.apply(q, k, v, scale)}
core_attention = ATTENTION["fp32"]


def rms_norm(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope_scaling(inv_freq, scaling):
    """inv_freq rescaled per config.json's rope_scaling (None or {} leaves it alone)."""
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return inv_freq
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        lo = float(scaling["low_freq_factor"])
        hi = float(scaling["high_freq_factor"])
        context = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths (low frequencies) are slowed by the factor, short ones kept, and
        # those between interpolated, weighting the unscaled frequency by s.
        s = (context / wavelen - lo) / (hi - lo)
        between = (1 - s) * (inv_freq / factor) + s * inv_freq
        out = torch.where(wavelen > context / lo, inv_freq / factor, between)
        return torch.where(wavelen < context / hi, inv_freq, out)
    raise ValueError(f"rope_scaling type {kind!r} is not known to the oracle")


def rope_tables(seq, head_dim, theta, scaling):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    inv_freq = apply_rope_scaling(inv_freq, scaling)
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), inv_freq)
    emb = torch.cat((angles, angles), dim=-1)  # [T, head_dim]
    return emb.cos(), emb.sin()


def attention(x, p, prefix, cfg, cos, sin):
    B, T, _ = x.shape
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg["head_dim"]
    q = mm(x, p[prefix + "q_proj.weight"].T)
    k = mm(x, p[prefix + "k_proj.weight"].T)
    v = mm(x, p[prefix + "v_proj.weight"].T)
    if cfg.get("model_type") == "qwen2":  # Qwen2: biases on the q, k and v projections
        q = q + p[prefix + "q_proj.bias"]
        k = k + p[prefix + "k_proj.bias"]
        v = v + p[prefix + "v_proj.bias"]
    q = q.view(B, T, nh, hd)
    k = k.view(B, T, nkv, hd)
    v = v.view(B, T, nkv, hd).transpose(1, 2)
    if cfg.get("model_type") == "qwen3":  # Qwen3: RMSNorm over each head, before RoPE
        q = rms_norm(q, p[prefix + "q_norm.weight"], cfg["rms_norm_eps"])
        k = rms_norm(k, p[prefix + "k_norm.weight"], cfg["rms_norm_eps"])
    q = q.transpose(1, 2)
    k = k.transpose(1, 2)
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    group = nh // nkv
    k = k.repeat_interleave(group, dim=1)  # query head h uses kv head h // group
    v = v.repeat_interleave(group, dim=1)
    out = core_attention(q, k, v, 1.0 / math.sqrt(hd))  # [B, nh, T, hd]
    out = out.transpose(1, 2).reshape(B, T, nh * hd)
    return mm(out, p[prefix + "o_proj.weight"].T)


def mlp(x, p, prefix):
    gate = mm(x, p[prefix + "gate_proj.weight"].T)
    up = mm(x, p[prefix + "up_proj.weight"].T)
    return mm(torch.nn.functional.silu(gate) * up, p[prefix + "down_proj.weight"].T)


def forward(cfg, p, tokens, targets):
    eps = cfg["rms_norm_eps"]
    B, T = tokens.shape
    cos, sin = rope_tables(T, cfg["head_dim"], cfg.get("rope_theta", 10000.0),
                           cfg.get("rope_scaling"))
    h = p["model.embed_tokens.weight"][tokens]
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        h = h + attention(rms_norm(h, p[pre + "input_layernorm.weight"], eps), p,
                          pre + "self_attn.", cfg, cos, sin)
        h = h + mlp(rms_norm(h, p[pre + "post_attention_layernorm.weight"], eps), p, pre + "mlp.")
    h = rms_norm(h, p["model.norm.weight"], eps)
    head = p["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings") else p["lm_head.weight"]
    logits = mm(h, head.T).reshape(B * T, -1)
    # outcore's head: the sum over the targets not ignored (-1, a loss mask) over all B*T rows
    # (the trainer divides by the step's trained targets instead); the mean without a mask.
    loss = torch.nn.functional.cross_entropy(logits, targets.reshape(-1), ignore_index=-1,
                                             reduction="sum") / targets.numel()
    return logits, loss


def run_case(case_dir):
    with open(os.path.join(case_dir, "case.json")) as f:
        compute = json.load(f).get("compute", "fp32")
    run_with(case_dir, compute, "result.bin")
    if compute != "fp32":
        run_with(case_dir, "fp32", "result_fp32.bin")


def run_with(case_dir, compute, result_name):
    global mm, core_attention
    mm = MATMUL[compute]
    core_attention = ATTENTION[compute]
    with open(os.path.join(case_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    with open(os.path.join(case_dir, "case.json")) as f:
        case = json.load(f)
    B, T = case["batch"], case["seq"]
    raw = open(os.path.join(case_dir, "params.bin"), "rb").read()
    flat = torch.frombuffer(bytearray(raw), dtype=torch.float32).to(torch.float64)
    params, at = {}, 0
    for t in case["tensors"]:
        n = math.prod(t["shape"])
        params[t["name"]] = flat[at:at + n].reshape(t["shape"]).clone().requires_grad_(True)
        at += n
    assert at == flat.numel(), "params.bin size does not match case.json"

    def ids(name):
        data = open(os.path.join(case_dir, name), "rb").read()
        return torch.frombuffer(bytearray(data), dtype=torch.int32).to(torch.int64).reshape(B, T)

    logits, loss = forward(cfg, params, ids("tokens.bin"), ids("targets.bin"))
    (loss * case["loss_scale"]).backward()
    out = [logits.detach().reshape(-1), loss.detach().reshape(1)]
    for t in case["tensors"]:
        g = params[t["name"]].grad
        out.append(torch.zeros(math.prod(t["shape"])) if g is None else g.reshape(-1))
    with open(os.path.join(case_dir, result_name), "wb") as f:
        f.write(torch.cat(out).numpy().tobytes())


def main():
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    for case_dir in sys.argv[1:]:
        run_case(case_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
