#!/bin/bash
# cpu_kernels_bench at small shapes: one line per kernel with the host's time, the backend's and
# their ratio; bad input fails with a message on stderr and a non-zero exit.
# usage: cpu_kernels_bench_smoke.sh CPU_KERNELS_BENCH
set -u
bench=$1
fail() { echo "FAIL: $*" >&2; exit 1; }
shape=(--tokens 96 --hidden 256 --intermediate 512 --heads 4 --head-dim 64 --vocab 500 --reps 1)

out=$("$bench" "${shape[@]}" 2>&1) || fail "exited $?: $out"
for kernel in "rmsnorm_backward 96x256" "rope 96x4x64" "swiglu_backward 96x512" \
  "embedding_backward 96x256" "from_fp32 bf16 96x256"; do
  grep -Eq "^$kernel .* host +[0-9.]+ ms +backend +[0-9.]+ ms +host / backend [0-9.]+$" <<< "$out" ||
    fail "no line for $kernel in:
$out"
done

for bad in "--tokens 0" "--head-dim 63" "--reps x"; do
  # shellcheck disable=SC2086
  err=$("$bench" "${shape[@]}" $bad 2>&1 >/dev/null) && fail "$bad was accepted"
  [[ -n $err ]] || fail "$bad: no message"
done
echo "cpu_kernels_bench smoke: ok"
