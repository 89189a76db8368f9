#!/bin/bash
# zero_bench on a tiny model on the simulated device at the shape `outcore estimate` recommends
# (--recommended-shape), the gathered parameters kept through each step (--keep-params), as
# ./dev.sh gpu runs it: the three runs train that shape with bit-identical losses; without a
# drive to measure (--ref-gib 0) the flag is refused.
# usage: zero_bench_smoke.sh ZERO_BENCH SCRATCH_DIR
set -u
bench=$1
dir=$2/zero_bench_smoke
fail() { echo "FAIL: $*" >&2; exit 1; }
rm -rf "$dir"
trap 'rm -rf "$dir"' EXIT
args=(--hidden 128 --layers 2 --vocab 512 --seq 64 --device-fraction 1 --steps 1 --warmup 0
  --block 1 --nvme "$dir" --recommended-shape)

out=$("$bench" "${args[@]}" --ref-gib 0.0625 --keep-params 2>&1) || fail "exited $?: $out"
shape=$(grep -E '^shape \(as outcore estimate recommends' <<< "$out") || fail "no shape line in:
$out"
[[ $shape =~ micro-batch\ ([0-9]+)\ x\ accumulation\ ([0-9]+)\ =\ ([0-9]+)\ tokens ]] ||
  fail "shape line unreadable: $shape"
micro=${BASH_REMATCH[1]} gas=${BASH_REMATCH[2]} tokens=${BASH_REMATCH[3]}
[[ $tokens -eq $((micro * gas * 64)) ]] || fail "$tokens tokens is not $micro x $gas x 64"
grep -Eq "^model: .* seq 64 x micro $micro x gas $gas = $tokens tokens/step$" <<< "$out" ||
  fail "the runs did not train the recommended shape ($micro x $gas):
$out"
grep -q '^losses bit-identical: yes' <<< "$out" || fail "losses differ:
$out"

err=$("$bench" "${args[@]}" --ref-gib 0 2>&1 >/dev/null) && fail "--ref-gib 0 was accepted"
grep -q -- '--ref-gib > 0' <<< "$err" || fail "--ref-gib 0: the message does not say why: $err"
echo "zero_bench smoke: ok"
