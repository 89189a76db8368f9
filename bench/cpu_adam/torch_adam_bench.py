#!/usr/bin/python3
"""Times torch.optim.Adam(foreach=True) on one flat fp32 parameter, for bench_cpu_adam.

usage: torch_adam_bench.py N THREADS REPS
Prints one line "torch_adam_params_per_s <best over REPS steps>" on stdout.
Exit status 3 if torch cannot be imported, 2 for bad arguments.
"""
import sys
import time

try:
    import torch
except ImportError as e:
    print(f"torch unavailable: {e}", file=sys.stderr)
    sys.exit(3)


def main():
    if len(sys.argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    n, threads, reps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(threads)
    param = torch.nn.Parameter(torch.empty(n).uniform_(-1, 1))
    param.grad = torch.empty(n).uniform_(-1e-3, 1e-3)
    opt = torch.optim.Adam([param], lr=1e-3, weight_decay=0.0, foreach=True)
    opt.step()  # creates the state
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        opt.step()
        best = min(best, time.perf_counter() - start)
    print(f"torch {torch.__version__}, {threads} thread(s): {n / best / 1e9:.3f} G params/s",
          file=sys.stderr)
    print(f"torch_adam_params_per_s {n / best:.6e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
