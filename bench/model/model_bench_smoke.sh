#!/bin/bash
# model_bench end to end on the CPU at a tiny shape, with the flags `./dev.sh gpu` gives it on a
# GPU: bf16 compute, its ratio to fp32 compute, the head alone against its GEMMs' time, and
# --profile's table and attention line (the lines the GPU summary shows); activation
# checkpointing in fp32; bad input refused with a message and a non-zero exit.
# usage: model_bench_smoke.sh MODEL_BENCH
set -u
bench=$1
fail() { echo "FAIL: $*" >&2; exit 1; }
shape=(--hidden 128 --intermediate 256 --heads 4 --kv-heads 2 --layers 1 --vocab 512 --seq 64
  --steps 1 --threads 1)

out=$("$bench" "${shape[@]}" --batch 2 --compute bf16 --profile 2>&1) || fail "exited $?: $out"
for want in "^config: hidden 128, layers 1, seq 64, batch 2, vocab 512, bf16 parameters, bf16 compute" \
  "^model fwd\+bwd: +[0-9]+ tokens/s" \
  "ratio model/sgemm [0-9.]+$" \
  "^bf16 compute / fp32 compute tokens/s \(same parameters\): [0-9.]+$" \
  "^head \(loss forward \+ backward, vocab 512, 128 rows, .* per launch\): [0-9.]+ ms = [0-9.]+x" \
  "^profile of one step, each operation waited for" \
  "^attention forward \+ backward: [0-9.]+ ms, .* of the sgemm 2048\^3 rate \(goal >= 0.45\)$"; do
  grep -Eq "$want" <<< "$out" || fail "no line matching /$want/ in:
$out"
done

out=$("$bench" "${shape[@]}" --batch 1 --checkpointing 2>&1) || fail "--checkpointing exited $?: $out"
grep -Eq "^config: .* fp32 parameters, fp32 compute, checkpointing" <<< "$out" ||
  fail "--checkpointing: no config line in:
$out"

for bad in "--heads 3" "--compute fp16" "--device tpu"; do
  # shellcheck disable=SC2086
  err=$("$bench" "${shape[@]}" $bad 2>&1 >/dev/null) && fail "$bad was accepted"
  [[ -n $err ]] || fail "$bad: no message"
done
echo "model_bench smoke: ok"
