#!/bin/bash
# zero_large_bench on a tiny model on the simulated discrete device: two steps, each against the
# bounds measured in the same run (the CPU Adam bound among them), with CPU Adam's threads set by
# --cpuadam-cores-perc (the data path's pool has every hardware thread);
# a share outside (0, 1] refused; then one step at the shape `outcore estimate` recommends
# (--recommended-shape: its rates measured on the discrete device under the 200 MiB budget);
# then the variants ./dev.sh gpu runs, one step each.
# usage: zero_large_bench_smoke.sh ZERO_LARGE_BENCH SCRATCH_DIR
set -u
bench=$1
dir=$2/zero_large_bench_smoke
fail() { echo "FAIL: $*" >&2; exit 1; }
rm -rf "$dir"
trap 'rm -rf "$dir"' EXIT
args=(--device discrete --device-mb 200 --hidden 256 --intermediate 512 --layers 2 --heads 4
  --kv-heads 2 --vocab 1000 --seq 64 --ref-gib 0.0625 --compute-reps 1 --nvme "$dir")

out=$("$bench" "${args[@]}" --steps 2 --cpuadam-cores-perc 0.5 2>&1) || fail "exited $?: $out"
hw=$(getconf _NPROCESSORS_ONLN)  # what std::thread::hardware_concurrency counts
want=$(( (hw + 1) / 2 ))
grep -Eq "^engine CPU threads $want of $hw for CPU Adam, $hw for gradient sums and norms \(cpuadam_cores_perc 0.5\)$" <<< "$out" ||
  fail "no 'engine CPU threads $want' line in:
$out"
grep -Eq "^step 2: loss [0-9.]+, .*x the larger bound$" <<< "$out" || fail "no step 2 in:
$out"
grep -Eq "^step / max\(I/O bound, compute bound, PCIe bound, CPU Adam bound\)" <<< "$out" ||
  fail "no ratio in:
$out"
grep -Eq "^CPU Adam bound \(plan: [0-9.e+-]+ G elements at [0-9.e+-]+ G elements/s\): [0-9.]+ s$" \
  <<< "$out" || fail "no CPU Adam bound in:
$out"

err=$("$bench" "${args[@]}" --steps 2 --cpuadam-cores-perc 1.5 2>&1 >/dev/null) && fail "1.5 was accepted"
[[ -n $err ]] || fail "--cpuadam-cores-perc 1.5: no message"
out=$("$bench" "${args[@]}" --steps 1 --recommended-shape 2>&1) || fail "--recommended-shape exited $?: $out"
shape=$(grep -E '^shape \(as outcore estimate recommends' <<< "$out") || fail "no shape line in:
$out"
[[ $shape =~ micro-batch\ ([0-9]+)\ x\ accumulation\ ([0-9]+) ]] || fail "shape unreadable: $shape"
grep -Eq "^ZeRO stage 3, .* $((BASH_REMATCH[1] * 64)) tokens per micro-batch, ${BASH_REMATCH[2]} micro-batch\(es\) per step$" \
  <<< "$out" || fail "the run did not train the recommended shape:
$out"
grep -Eq "^step 1: loss [0-9.]+, " <<< "$out" || fail "no step 1 at the recommended shape:
$out"
# The variants ./dev.sh gpu runs: 4 micro-batches with gradient sums in host memory, the gathered
# parameters kept, with the optimizer step during the backward, and with the last unit's
# optimizer state on the device (offload_optimizer.ratio 0.9)
for variant in "--step-in-backward" "--offload-ratio 0.9"; do
  # shellcheck disable=SC2086
  out=$("$bench" "${args[@]}" --steps 1 --micro 1 --gas 4 --grads host --keep-params $variant 2>&1) ||
    fail "--keep-params $variant exited $?: $out"
  grep -Eq "^step 1: loss [0-9.]+, .*x the larger bound$" <<< "$out" ||
    fail "--keep-params $variant: no step 1 in:
$out"
done
echo "zero_large_bench smoke: ok"
