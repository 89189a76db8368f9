#!/bin/bash
# aio_bench end to end: a tiny sweep prints parseable JSON naming the aio backend and leaves
# no file behind; OUTCORE_AIO_BACKEND=sync runs (and is named) on the sync backend; where a
# seccomp filter refuses io_uring_setup the sweep falls back to sync with one warning; bad
# input exits 2 with one line on stderr; Ctrl-C exits 130, removes the benchmark file and
# recommends nothing.
# usage: aio_bench_smoke.sh AIO_BENCH WORK_DIR [AIO_DENY_IO_URING]
set -u
bench=$1
deny=${3:-}
work=$2/aio_bench_smoke.$$
mkdir -p "$work"
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

# 1. Tiny sweep, JSON out, backend chosen automatically.
tiny=(--path "$work" --block-sizes 128K --queue-depths 4 --file-size 16M --seconds 0.1)
env -u OUTCORE_AIO_BACKEND "$bench" "${tiny[@]}" --json > "$work/out.json" 2> "$work/err.txt" ||
  fail "tiny sweep exited $?: $(cat "$work/err.txt")"
python3 - "$work/out.json" <<'PY' || fail "JSON output does not hold the expected result"
import json, sys
doc = json.load(open(sys.argv[1]))
r = doc["results"]
assert len(r) == 1, r
assert r[0]["block_size"] == 131072 and r[0]["queue_depth"] == 4, r[0]
assert r[0]["read"]["gbps"] > 0 and r[0]["write"]["gbps"] > 0, r[0]
assert doc["best"]["aio"]["block_size"] == 131072, doc["best"]
assert doc["interrupted"] is False
b = doc["backend"]
assert b["forced"] is False, b
# io_uring, or sync with the reason io_uring could not be used
assert (b["name"], b["fallback_reason"] is None) in (("io_uring", True), ("sync", False)), b
PY
leftover=$(find "$work" -name 'aio_bench.*' | head -1)
[ -z "$leftover" ] || fail "benchmark file left behind: $leftover"

# 1a. A user's file at the benchmark file's name (aio_bench.<pid>.dat) is kept: the sweep takes
# another name (the subshell's pid is the benchmark's after exec).
(echo "the user's data" > "$work/aio_bench.$BASHPID.dat"
 exec env -u OUTCORE_AIO_BACKEND "$bench" "${tiny[@]}" > /dev/null 2> "$work/err.txt") ||
  fail "sweep beside a user's file of its name exited $?: $(cat "$work/err.txt")"
users=$(find "$work" -name 'aio_bench.*.dat')
[ "$(cat $users)" = "the user's data" ] || fail "the user's file $users was changed"
rm -f $users
leftover=$(find "$work" -name 'aio_bench.*' | head -1)
[ -z "$leftover" ] || fail "benchmark file left behind: $leftover"

# 1b. OUTCORE_AIO_BACKEND=sync: the sweep runs on the sync backend and says so, in JSON and
# in the table header.
OUTCORE_AIO_BACKEND=sync "$bench" "${tiny[@]}" --json > "$work/out.json" 2> "$work/err.txt" ||
  fail "forced sync sweep exited $?: $(cat "$work/err.txt")"
python3 - "$work/out.json" <<'PY' || fail "forced sync: JSON does not name the sync backend"
import json, sys
doc = json.load(open(sys.argv[1]))
assert doc["backend"] == {"name": "sync", "forced": True, "fallback_reason": None}, doc["backend"]
assert doc["results"][0]["read"]["gbps"] > 0 and doc["results"][0]["write"]["gbps"] > 0
PY
OUTCORE_AIO_BACKEND=sync "$bench" "${tiny[@]}" > "$work/out.txt" 2> "$work/err.txt" ||
  fail "forced sync table exited $?: $(cat "$work/err.txt")"
grep -q "^aio backend: sync (forced by OUTCORE_AIO_BACKEND)$" "$work/out.txt" ||
  fail "table header does not name the sync backend: $(head -3 "$work/out.txt")"

# 1c. io_uring_setup refused by the kernel (a seccomp filter, as in a container): the sweep
# runs on sync, the JSON says why, and stderr holds one warning naming the cause and the cost.
if [ -n "$deny" ]; then
  env -u OUTCORE_AIO_BACKEND "$deny" 1 "$bench" "${tiny[@]}" --json > "$work/out.json" \
    2> "$work/err.txt"
  rc=$?
  if [ $rc -eq 77 ]; then
    echo "SKIP fallback under seccomp: $(cat "$work/err.txt")"
  else
    [ $rc -eq 0 ] || fail "sweep with io_uring refused exited $rc: $(cat "$work/err.txt")"
    python3 - "$work/out.json" <<'PY' || fail "io_uring refused: JSON does not show the fallback"
import json, sys
b = json.load(open(sys.argv[1]))["backend"]
assert b["name"] == "sync" and b["forced"] is False, b
assert "io_uring_queue_init failed with EPERM" in b["fallback_reason"], b
PY
    [ "$(grep -c "io_uring cannot be used" "$work/err.txt")" -eq 1 ] ||
      fail "io_uring refused: expected one fallback warning: $(cat "$work/err.txt")"
    grep -q "one request at a time" "$work/err.txt" ||
      fail "io_uring refused: the warning does not name the cost: $(cat "$work/err.txt")"
    # Forcing io_uring there is bad input naming the cause.
    OUTCORE_AIO_BACKEND=io_uring "$deny" 38 "$bench" "${tiny[@]}" > /dev/null 2> "$work/err.txt"
    rc=$?
    [ $rc -eq 2 ] || fail "forced io_uring where refused: exit $rc, expected 2"
    grep -q "OUTCORE_AIO_BACKEND=io_uring, but io_uring cannot be used: .*ENOSYS" \
      "$work/err.txt" || fail "forced io_uring where refused: $(cat "$work/err.txt")"
  fi
fi

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
# Refused before the benchmark file is written (one line: no "writing the ... file" first).
EXPECT="every block size x thread count exceeds --file-size" \
  expect2 "blocks beyond the file" --path "$work" --file-size 4M --block-sizes 8M
EXPECT="path" expect2 "no path"
EXPECT="--seconds nan: expected more than 0" expect2 "nan seconds" --path "$work" --seconds nan
EXPECT="--budget -5: expected more than 0" expect2 "negative budget" --path "$work" --budget -5
EXPECT="--budget nan: expected more than 0" expect2 "nan budget" --path "$work" --budget nan
EXPECT="--tolerance nan: expected at least 0" expect2 "nan tolerance" --path "$work" --tolerance nan
EXPECT="--tolerance 2: expected at least 0" expect2 "tolerance 2" --path "$work" --tolerance 2
EXPECT="OUTCORE_AIO_BACKEND=uring: not a backend (allowed values: io_uring, sync" \
  OUTCORE_AIO_BACKEND=uring expect2 "bad backend" --path "$work"
rm -f "$work/plain_file"

# sweep_running ARGS...: starts a sweep with ARGS in the background (its pid in $pid), and
# returns once its benchmark file exists and it has measured for a second. With job control on
# (set -m): a non-interactive shell otherwise starts it with SIGINT ignored, which aio_bench
# keeps ignored, as under nohup.
# IGNORE_HUP=1 starts it with SIGHUP ignored, as nohup does.
sweep_running() {
  set -m
  (if [ -n "${IGNORE_HUP:-}" ]; then trap '' HUP; fi
    exec "$bench" --path "$work" --file-size 64M "$@" > "$work/out.txt" 2> "$work/err.txt") &
  pid=$!
  set +m
  for _ in $(seq 100); do
    [ -n "$(find "$work" -name 'aio_bench.*.dat')" ] && break
    sleep 0.05
  done
  sleep 1
}
# 3. Ctrl-C during a sweep: exit 130, file removed, and no "aio" section recommended from
# the settings measured so far.
sweep_running --seconds 0.3
kill -INT $pid
wait $pid
rc=$?
[ $rc -eq 130 ] || fail "after SIGINT: exit $rc, expected 130 ($(cat "$work/err.txt"))"
leftover=$(find "$work" -name 'aio_bench.*' | head -1)
[ -z "$leftover" ] || fail "benchmark file left after SIGINT: $leftover"
grep -q '"aio"' "$work/out.txt" && fail "after SIGINT: an aio section was recommended: $(cat "$work/out.txt")"
grep -q "^Best performance" "$work/out.txt" && fail "after SIGINT: a best setting was claimed"
# 3a. A second stop signal ends the run at once, by that signal (not the orderly stop, which
# says "interrupted"), and the benchmark file goes with it. Both are sent while the process is
# stopped (two different signals, so neither is merged into the other); either may be taken
# first.
sweep_running --seconds 2 --queue-depths 4,8 --threads 1
kill -STOP $pid
kill -INT $pid
kill -TERM $pid
kill -CONT $pid
wait $pid
rc=$?
[ $rc -eq 143 ] || [ $rc -eq 130 ] ||
  fail "after SIGINT and SIGTERM: exit $rc, expected the second's (143 or 130)"
grep -q "interrupted by signal" "$work/err.txt" &&
  fail "after SIGINT and SIGTERM: the second did not end the run at once: $(cat "$work/err.txt")"
leftover=$(find "$work" -name 'aio_bench.*' | head -1)
[ -z "$leftover" ] || fail "benchmark file left after a second signal: $leftover"
# 3a'. A SIGHUP ignored at start (nohup) stays ignored: the sweep goes on; SIGTERM still stops it.
IGNORE_HUP=1 sweep_running --seconds 3 --queue-depths 4,8 --threads 1
kill -HUP $pid
sleep 0.5
kill -0 $pid 2> /dev/null || fail "a SIGHUP ignored at start stopped the sweep: $(cat "$work/err.txt")"
kill -TERM $pid
wait $pid
rc=$?
[ $rc -eq 130 ] || [ $rc -eq 143 ] || fail "after SIGTERM under nohup: exit $rc"
# 3b. Results that cannot be written (a full disk) exit 1 saying so.
if [ -w /dev/full ]; then
  "$bench" --path "$work" --file-size 4M --block-sizes 1M --queue-depths 4 --threads 1 \
    --seconds 0.1 --json > /dev/full 2> "$work/err.txt"
  rc=$?
  [ $rc -eq 1 ] || fail "results to /dev/full: exit $rc, expected 1"
  grep -q "cannot write the results to stdout" "$work/err.txt" ||
    fail "results to /dev/full: $(cat "$work/err.txt")"
fi
# 3c. A file-size limit (ulimit -f) below the benchmark file: the failed write is reported
# (never SIGXFSZ ending the process) and the file removed.
(ulimit -f 1000
 exec "$bench" --path "$work" --file-size 8M --block-sizes 128K --queue-depths 4 --threads 1 \
   --seconds 0.05) > /dev/null 2> "$work/err.txt"
rc=$?
[ $rc -eq 1 ] || [ $rc -eq 2 ] || fail "under ulimit -f: exit $rc, expected 1 or 2 ($(cat "$work/err.txt"))"
grep -q "no room for a 8M file (File too large" "$work/err.txt" ||
  fail "under ulimit -f: the failed write is not named: $(cat "$work/err.txt")"
leftover=$(find "$work" -name 'aio_bench.*' | head -1)
[ -z "$leftover" ] || fail "benchmark file left under ulimit -f: $leftover"
# 3d. Started with stdout and stderr closed: the sweep runs (the files it opens do not take
# their numbers) and leaves nothing.
"$bench" "${tiny[@]}" >&- 2>&-
rc=$?
[ $rc -eq 0 ] || fail "with stdout and stderr closed: exit $rc"
leftover=$(find "$work" -name 'aio_bench.*' | head -1)
[ -z "$leftover" ] || fail "benchmark file left with stdout and stderr closed: $leftover"
# 4. --compare-fio: fio's output goes to a directory of its own, so nothing beside the benchmark
# file is opened: a link planted at a name next to it (the scratch file's, the pid's that
# `exec` keeps) is not written through, and the directory holds what it held.
if command -v fio > /dev/null; then
  echo PRECIOUS > "$work/victim.txt"
  mkdir "$work/fio"
  sh -c 'for s in fio.json fio.err; do ln -s "$1/victim.txt" "$1/fio/aio_bench.$$.dat.$s"; done
         exec "$2" --path "$1/fio" --compare-fio --file-size 4M --block-sizes 256K \
           --queue-depths 1 --threads 1 --seconds 0.1' sh "$work" "$bench" \
    > "$work/out.txt" 2> "$work/err.txt" || fail "--compare-fio exited $?: $(cat "$work/err.txt")"
  [ "$(cat "$work/victim.txt")" = PRECIOUS ] || fail "--compare-fio wrote through a link"
  [ "$(find "$work/fio" -mindepth 1 | wc -l)" -eq 2 ] ||
    fail "--compare-fio changed its directory: $(ls -la "$work/fio")"
else
  echo "SKIP --compare-fio: no fio on this machine"
fi
# 4b. fio failing part-way: the figures measured so far are printed, with no recommendation, and
# the run exits 1 naming fio's error (a fio that answers --version and fails every measurement).
mkdir "$work/badfio"
printf '#!/bin/sh\n[ "$1" = --version ] && exit 0\necho "fio: simulated failure" >&2\nexit 3\n' \
  > "$work/badfio/fio"
chmod +x "$work/badfio/fio"
PATH="$work/badfio:$PATH" "$bench" --path "$work" --compare-fio --file-size 4M \
  --block-sizes 256K,1M --queue-depths 1 --threads 1 --seconds 0.1 > "$work/out.txt" \
  2> "$work/err.txt"
rc=$?
[ $rc -eq 1 ] || fail "failing fio: exit $rc, expected 1: $(cat "$work/err.txt")"
grep -q "simulated failure" "$work/err.txt" || fail "failing fio not named: $(cat "$work/err.txt")"
grep -q "fio failed after 1 setting(s): no recommendation" "$work/out.txt" ||
  fail "failing fio: the figures so far were not printed: $(cat "$work/out.txt")"
grep -q "Best performance" "$work/out.txt" && fail "failing fio: a recommendation was printed"
[ -z "$(find "$work" -maxdepth 1 -name 'aio_bench.*')" ] || fail "failing fio left its file"
# 5. A directory on a filesystem in memory is warned about: its figures are memory's.
mkdir "$work/mem"
if mount -t tmpfs -o size=32m tmpfs "$work/mem" 2> /dev/null; then
  env -u OUTCORE_AIO_BACKEND "$bench" --path "$work/mem" --block-sizes 128K --queue-depths 4 \
    --file-size 4M --seconds 0.1 > /dev/null 2> "$work/err.txt"
  rc=$?
  umount "$work/mem"
  [ $rc -eq 0 ] || fail "sweep on tmpfs exited $rc: $(cat "$work/err.txt")"
  grep -q "is on a filesystem in memory (tmpfs)" "$work/err.txt" ||
    fail "no warning on tmpfs: $(cat "$work/err.txt")"
else
  echo "SKIP tmpfs warning: cannot mount a tmpfs here"
fi
echo "aio_bench smoke: OK"
