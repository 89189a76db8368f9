#!/usr/bin/env python3
"""PyTorch's causal scaled_dot_product_attention at one shape, forward and backward, per backend.

The reference that bench/model/attention_bench runs with --reference: for each of PyTorch's
fused backends (FlashAttention-2, cuDNN, memory-efficient) it prints

    sdpa NAME forward_ms F backward_ms B

the best of --reps timed runs after a warm-up (CUDA events), bf16 operands of shape
[batch, heads, seq, head_dim] (keys and values with --kv-heads heads, grouped as GQA; a backend
that refuses groups runs with them repeated per head and is named NAME-kv-repeated), or

    sdpa NAME unavailable: WHY

Needs PyTorch 2.5 or later with a GPU (the image of a GPU machine has it; Debian's does not).
"""
import argparse
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()

    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError as e:
        print(f"sdpa all unavailable: {e}")
        return 0
    if not torch.cuda.is_available():
        print("sdpa all unavailable: torch sees no GPU")
        return 0

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(7)

    def operand(heads):
        return torch.randn(args.batch, heads, args.seq, args.head_dim, device=dev,
                           dtype=torch.bfloat16, generator=gen)

    q0, k0, v0 = operand(args.heads), operand(args.kv_heads), operand(args.kv_heads)
    dout = operand(args.heads)

    def timed(fn):
        best = float("inf")
        for r in range(args.reps + 1):  # run 0 warms up
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            if r > 0:
                best = min(best, start.elapsed_time(end))
        return best

    backends = [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                ("efficient", SDPBackend.EFFICIENT_ATTENTION)]
    group = args.heads // args.kv_heads

    def measure(backend, gqa):
        """Forward and backward ms: grouped keys and values (gqa), or each repeated per head."""
        with sdpa_kernel(backend):
            if gqa:
                q, k, v = (t.detach().requires_grad_() for t in (q0, k0, v0))
            else:
                q = q0.detach().requires_grad_()
                k, v = (t.repeat_interleave(group, dim=1).detach().requires_grad_()
                        for t in (k0, v0))

            def fwd():
                if gqa:
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

            fwd_ms = timed(fwd)
            out = fwd()

            def bwd():
                q.grad = k.grad = v.grad = None
                out.backward(dout, retain_graph=True)

            return fwd_ms, timed(bwd)

    for name, backend in backends:
        try:
            try:
                fwd_ms, bwd_ms = measure(backend, gqa=True)
            except RuntimeError:
                # A backend without grouped keys: the same work with them repeated per head.
                fwd_ms, bwd_ms = measure(backend, gqa=False)
                name += "-kv-repeated"
            print(f"sdpa {name} forward_ms {fwd_ms:.4f} backward_ms {bwd_ms:.4f}")
        except RuntimeError as e:
            why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            print(f"sdpa {name} unavailable: {why}")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
