#!/bin/bash
# A benchmark's plumbing end to end at a tiny size: it exits 0, prints every line its readers
# look for (each PATTERN, an extended regex, matches a line of its output), and leaves nothing
# in the scratch directory it was given.
# usage: bench_smoke.sh SCRATCH_DIR PATTERN... -- BENCHMARK ARGS...   (@DIR@ in ARGS: SCRATCH_DIR)
set -u
dir=$1
shift
patterns=()
while (($# > 0)) && [[ $1 != -- ]]; do
  patterns+=("$1")
  shift
done
[[ ${1:-} == -- ]] || { echo "usage: bench_smoke.sh SCRATCH_DIR PATTERN... -- BENCHMARK ARGS..." >&2; exit 2; }
shift
fail() { echo "FAIL: $*" >&2; exit 1; }
rm -rf "$dir"
mkdir -p "$dir"
trap 'rm -rf "$dir"' EXIT
cmd=("${@//@DIR@/$dir}")
out=$("${cmd[@]}" 2>&1) || fail "${cmd[*]}: exited $?:
$out"
for p in "${patterns[@]}"; do
  grep -Eq -- "$p" <<< "$out" || fail "no line matches /$p/ in the output of ${cmd[*]}:
$out"
done
left=$(find "$dir" -mindepth 1 | head -5)
[[ -z $left ]] || fail "${cmd[*]} left files in its scratch directory: $left"
echo "$(basename "$1") smoke: ok"
