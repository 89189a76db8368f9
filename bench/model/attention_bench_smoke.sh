#!/bin/bash
# attention_bench end to end on the CPU: each sequence length prints its forward and backward
# times and its ratio to the GEMM peak; a --reference command's `sdpa` lines come back with their
# ratios (and an unavailable backend says so); a reference that prints none, or bad input, fails
# with one message on stderr and a non-zero exit.
# usage: attention_bench_smoke.sh ATTENTION_BENCH
set -u
bench=$1
fail() { echo "FAIL: $*" >&2; exit 1; }
shape=(--device cpu --heads 4 --kv-heads 2 --head-dim 32 --reps 1)

out=$("$bench" "${shape[@]}" --seq 64,96 \
  --reference "echo sdpa stub forward_ms 1.0 backward_ms 2.0; echo sdpa other unavailable: none here #" \
  2>&1) || fail "exited $?: $out"
for want in "^cpu, bf16 operands; GEMM peak" \
  "^attention seq 64: forward \+ backward .* of the GEMM peak" \
  "^seq 96 \(batch 1, 4 heads of 32 over 2 kv heads, GEMMs head by head\): forward [0-9.]+ ms" \
  "^reference seq 96 stub: forward 1.000 ms, backward 2.000 ms; its time / outcore's: forward [0-9.]+, backward [0-9.]+, both [0-9.]+$" \
  "^reference seq 64 other: unavailable: none here$"; do
  grep -Eq "$want" <<< "$out" || fail "no line matching /$want/ in:
$out"
done

err=$("$bench" "${shape[@]}" --seq 64 --reference "true #" 2>&1 >/dev/null) &&
  fail "a reference printing nothing was accepted"
grep -q "printed no \`sdpa\` line" <<< "$err" || fail "no reason given: $err"

for bad in "--seq 0" "--seq 64,x" "--heads 3"; do
  # shellcheck disable=SC2086
  err=$("$bench" "${shape[@]}" $bad 2>&1 >/dev/null) && fail "$bad was accepted"
  [[ -n $err ]] || fail "$bad: no message"
done
echo "attention_bench smoke: ok"
