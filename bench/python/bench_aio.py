#!/usr/bin/python3
"""outcore.aio.Handle from Python against aio_bench (the C++ engine, same settings, its own file
of the same size in the same directory) and fio (io_uring, O_DIRECT, same settings, on the very
file Python used), all in this run. Sequential reads and writes streamed as aio_bench does:
a pinned buffer of --io-size cut into 4 spans kept in flight, wrapping around the file.

usage: bench_aio.py --build BUILD_DIR --path DIR [--file-size 1G] [--io-size 64M]
                    [--block-size 1M] [--queue-depth 32] [--seconds 3]
"""
import argparse
import json
import os
import subprocess
import sys
import time

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def size(text):
    return int(text[:-1]) * UNITS[text[-1].upper()] if text[-1].upper() in UNITS else int(text)


def python_gbps(outcore, torch, path, a, write):
    """GB/s (1e9 B/s) of outcore.aio from Python: 4 spans in flight for a.seconds."""
    h = outcore.aio.Handle(block_size=a.block_size, queue_depth=a.queue_depth)
    buf = h.new_pinned_tensor(a.io_size, torch.uint8)
    buf.fill_(7)
    span = a.io_size // 4
    spans = [buf[i * span:(i + 1) * span] for i in range(4)]
    positions = a.file_size // span
    issue = h.async_pwrite if write else h.async_pread
    nxt, done_bytes = 0, 0
    reqs = []
    t0 = time.perf_counter()
    for s in range(4):
        reqs.append(issue(spans[s], path, (nxt % positions) * span))
        nxt += 1
    s = 0
    while reqs[s] is not None:
        reqs[s].wait()
        done_bytes += span
        if time.perf_counter() - t0 < a.seconds:
            reqs[s] = issue(spans[s], path, (nxt % positions) * span)
            nxt += 1
        else:
            reqs[s] = None
        s = (s + 1) % 4
    for r in reqs:
        if r is not None:
            r.wait()
            done_bytes += span
    elapsed = time.perf_counter() - t0
    h.free_pinned_tensor(buf)
    return done_bytes / elapsed / 1e9


def fio_gbps(path, a, write):
    cmd = ["fio", "--name=bench_aio_py", f"--filename={path}",
           f"--rw={'write' if write else 'read'}", f"--bs={a.block_size}",
           f"--iodepth={a.queue_depth}", "--ioengine=io_uring", "--direct=1", "--thread",
           "--invalidate=0", "--fallocate=none", "--numjobs=1", f"--size={a.file_size}",
           f"--iodepth_batch_submit={a.queue_depth}", "--iodepth_batch_complete_min=1",
           "--time_based", f"--runtime={int(a.seconds * 1000)}ms", "--output-format=json"]
    out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    job = out["jobs"][0]["write" if write else "read"]
    return job["io_bytes"] / (job["runtime"] / 1000) / 1e9


def aio_bench_gbps(a):
    exe = os.path.join(a.build, "bin", "aio_bench")
    cmd = [exe, "--path", a.path, "--file-size", str(a.file_size), "--io-size", str(a.io_size),
           "--block-sizes", str(a.block_size), "--queue-depths", str(a.queue_depth),
           "--threads", "1", "--single-submit", "false", "--overlap-events", "true",
           "--seconds", str(a.seconds), "--json"]
    print("running:", " ".join(cmd), file=sys.stderr)
    out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    r = out["results"][0]
    return r["read"]["gbps"], r["write"]["gbps"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", required=True)
    ap.add_argument("--path", required=True, help="directory on the drive to test")
    ap.add_argument("--file-size", type=size, default=size("1G"))
    ap.add_argument("--io-size", type=size, default=size("64M"))
    ap.add_argument("--block-size", type=size, default=size("1M"))
    ap.add_argument("--queue-depth", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=3.0)
    a = ap.parse_args()
    sys.path.insert(0, os.path.join(a.build, "python"))
    import torch
    import outcore

    os.makedirs(a.path, exist_ok=True)
    path = os.path.join(a.path, f"bench_aio_py.{os.getpid()}.bin")
    try:
        h = outcore.aio.Handle(block_size=a.block_size, queue_depth=a.queue_depth)
        chunk = h.new_pinned_tensor(a.io_size, torch.uint8)
        chunk.fill_(1)
        for off in range(0, a.file_size, a.io_size):  # lay the file out once
            h.pwrite(chunk, path, offset=off)
        os.sync()
        results = {}
        for write in (False, True):
            kind = "write" if write else "read"
            results[("python", kind)] = python_gbps(outcore, torch, path, a, write)
            results[("fio", kind)] = fio_gbps(path, a, write)
        results[("aio_bench", "read")], results[("aio_bench", "write")] = aio_bench_gbps(a)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    print(f"bench_aio.py: {a.path}, file {a.file_size >> 20} MiB, io {a.io_size >> 20} MiB in 4 "
          f"spans, block {a.block_size >> 10} KiB, queue depth {a.queue_depth}, 1 thread, "
          f"{a.seconds:g} s per measurement, backend {h.backend()}")
    print(f"{'':34s} {'read GB/s':>10s} {'write GB/s':>11s} {'Python/this rd':>15s} "
          f"{'Python/this wr':>15s}")
    for who, name in (("python", "outcore.aio.Handle (Python)"),
                      ("aio_bench", "aio_bench (C++ engine)"),
                      ("fio", "fio (io_uring, direct)")):
        rd, wr = results[(who, "read")], results[(who, "write")]
        print(f"{name:34s} {rd:10.3f} {wr:11.3f} {results[('python', 'read')] / rd:14.3f}x "
              f"{results[('python', 'write')] / wr:14.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
