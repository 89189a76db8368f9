#!/usr/bin/python3
"""Reference Adam/AdamW trajectories from torch.optim, for tests/cpu_adam/torch_oracle_test.cpp.

usage: torch_adam_oracle.py OUT_DIR N STEPS

Writes one file per case into OUT_DIR (adam_l2.bin, adamw.bin, adamw_bf16_grads.bin,
adam_l2_bf16_moments.bin, adamw_bf16_moments.bin). Each is little-endian:
  magic "OCADAM02", u32 n, u32 steps, u32 adamw, u32 bf16_grads, u32 bf16_moments,
  f64 beta1, beta2, eps, weight_decay, f64 lr[steps],
  f32 p0[n], f32 grads[steps][n], f32 p[n], f32 exp_avg[n], f32 exp_avg_sq[n]
With bf16_moments, exp_avg and exp_avg_sq are rounded to bf16 (nearest even) after every
torch step: the update of a step uses its fp32 moments, the next step starts from the rounded
ones, as DeepSpeed's CPU Adam with fp32_optimizer_states=False does. The final moments are
written widened to f32 (exactly).
Exit status 3 if torch cannot be imported (the test skips), 2 for bad arguments.
"""
import os
import struct
import sys

try:
    import torch
except ImportError as e:  # the caller turns this into a visible skip
    print(f"torch unavailable: {e}", file=sys.stderr)
    sys.exit(3)

CASES = [
    # name, optimizer class, weight decay, gradients rounded to bf16, moments stored in bf16
    ("adam_l2", "Adam", 0.01, False, False),
    ("adamw", "AdamW", 0.1, False, False),
    ("adamw_bf16_grads", "AdamW", 0.05, True, False),
    ("adam_l2_bf16_moments", "Adam", 0.01, False, True),
    ("adamw_bf16_moments", "AdamW", 0.1, True, True),
]
BETAS = (0.9, 0.999)
EPS = 1e-8


def lr_at(step):
    # Warm-up then decay, so the rate changes every step.
    return 1e-3 * min(step / 5.0, 1.0) * (0.9 ** max(step - 5, 0)) + 1e-5


def make_inputs(n, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    p0 = torch.randn(n, generator=gen) * torch.logspace(-3, 1, n)[torch.randperm(n, generator=gen)]
    grads = []
    for _ in range(steps):
        g = torch.randn(n, generator=gen) * 10.0 ** torch.randint(-4, 2, (n,), generator=gen)
        g[torch.rand(n, generator=gen) < 0.02] = 0.0  # some exact zeros
        grads.append(g)
    return p0, grads


def run_case(out_dir, name, opt_name, wd, bf16_grads, bf16_moments, n, steps, seed):
    p0, grads = make_inputs(n, steps, seed)
    if bf16_grads:
        grads = [g.bfloat16().float() for g in grads]
    param = torch.nn.Parameter(p0.clone())
    opt_cls = getattr(torch.optim, opt_name)
    opt = opt_cls([param], lr=lr_at(1), betas=BETAS, eps=EPS, weight_decay=wd, foreach=False)
    lrs = []
    for t in range(1, steps + 1):
        for group in opt.param_groups:
            group["lr"] = lr_at(t)
        lrs.append(lr_at(t))
        param.grad = grads[t - 1].clone()
        opt.step()
        if bf16_moments:
            for key in ("exp_avg", "exp_avg_sq"):
                s = opt.state[param][key]
                s.copy_(s.bfloat16().float())
    state = opt.state[param]
    with open(os.path.join(out_dir, name + ".bin"), "wb") as f:
        f.write(b"OCADAM02")
        f.write(struct.pack("<5I", n, steps, 1 if opt_name == "AdamW" else 0, int(bf16_grads),
                            int(bf16_moments)))
        f.write(struct.pack("<4d", BETAS[0], BETAS[1], EPS, wd))
        f.write(struct.pack(f"<{steps}d", *lrs))
        for t in [p0] + grads + [param.detach(), state["exp_avg"], state["exp_avg_sq"]]:
            f.write(t.contiguous().float().numpy().tobytes())


def main():
    if len(sys.argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    out_dir, n, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    for i, (name, opt_name, wd, bf16_grads, bf16_moments) in enumerate(CASES):
        run_case(out_dir, name, opt_name, wd, bf16_grads, bf16_moments, n, steps, seed=1234 + i)
    print(f"torch {torch.__version__}: wrote {len(CASES)} cases to {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
