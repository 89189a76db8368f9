#!/bin/bash
# aio_bench end to end: a tiny sweep prints parseable JSON and leaves no file behind; bad
# input exits 2 with one line on stderr; Ctrl-C exits 130 and removes the benchmark file.
# usage: aio_bench_smoke.sh AIO_BENCH WORK_DIR
set -u
bench=$1
work=$2/aio_bench_smoke.$$
mkdir -p "$work"
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

# 1. Tiny sweep, JSON out.
"$bench" --path "$work" --block-sizes 128K --queue-depths 4 --file-size 16M --seconds 0.1 \
  --json > "$work/out.json" 2> "$work/err.txt" || fail "tiny sweep exited $?: $(cat "$work/err.txt")"
python3 - "$work/out.json" <<'PY' || fail "JSON output does not hold the expected result"
import json, sys
doc = json.load(open(sys.argv[1]))
r = doc["results"]
assert len(r) == 1, r
assert r[0]["block_size"] == 131072 and r[0]["queue_depth"] == 4, r[0]
assert r[0]["read"]["gbps"] > 0 and r[0]["write"]["gbps"] > 0, r[0]
assert doc["best"]["aio"]["block_size"] == 131072, doc["best"]
assert doc["interrupted"] is False
PY
leftover=$(find "$work" -name 'aio_bench.*' | head -1)
[ -z "$leftover" ] || fail "benchmark file left behind: $leftover"

# 2. Bad input: exit 2, one line on stderr naming the problem.
expect2() {
  local what=$1; shift
  "$bench" "$@" > /dev/null 2> "$work/err.txt"
  local rc=$?
  [ $rc -eq 2 ] || fail "$what: exit $rc, expected 2 ($(cat "$work/err.txt"))"
  [ "$(wc -l < "$work/err.txt")" -eq 1 ] || fail "$what: expected one line, got: $(cat "$work/err.txt")"
  grep -q -- "$EXPECT" "$work/err.txt" || fail "$what: message lacks '$EXPECT': $(cat "$work/err.txt")"
}
touch "$work/plain_file"
EXPECT="no such directory" expect2 "missing dir" --path "$work/missing"
EXPECT="not a directory" expect2 "not a dir" --path "$work/plain_file"
EXPECT="not enough free space" expect2 "no space" --path "$work" --file-size 1000T
EXPECT="not a size" expect2 "bad size" --path "$work" --file-size banana
EXPECT="multiple of 4K" expect2 "bad block" --path "$work" --block-sizes 1000
EXPECT="true or false" expect2 "bad bool" --path "$work" --single-submit maybe
EXPECT="path" expect2 "no path"
rm -f "$work/plain_file"

# 3. Ctrl-C during a sweep: exit 130, file removed.
"$bench" --path "$work" --file-size 64M --seconds 0.3 > /dev/null 2> "$work/err.txt" &
pid=$!
for _ in $(seq 100); do
  [ -n "$(find "$work" -name 'aio_bench.*.dat')" ] && break
  sleep 0.05
done
sleep 1
kill -INT $pid
wait $pid
rc=$?
[ $rc -eq 130 ] || fail "after SIGINT: exit $rc, expected 130 ($(cat "$work/err.txt"))"
leftover=$(find "$work" -name 'aio_bench.*' | head -1)
[ -z "$leftover" ] || fail "benchmark file left after SIGINT: $leftover"
echo "aio_bench smoke: OK"
