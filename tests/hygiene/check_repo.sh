#!/usr/bin/env bash
# Repository hygiene, run by ctest (label "hygiene"): check_repo.sh SOURCE_DIR
#   1. No library source (aio/, cpu_adam/, swap/, engine/) calls getenv or secure_getenv: the
#      libraries take their settings as arguments; only tools/, bench/, examples/ and the
#      Python module read the environment (tools/env_settings.hpp).
#   2. No tracked file holds an absolute path into a machine's home or work directory
#      (a user's home, root's home, the work directory, a macOS Users directory): such paths
#      work on one machine only.
# Prints each offending FILE:LINE: TEXT and exits 1; exits 0 when clean. Exits 77 (a skip) when
# SOURCE_DIR is not a git checkout, after check 1 passed (check 2 needs the list of tracked
# files).
set -uo pipefail

root=${1:?usage: check_repo.sh SOURCE_DIR}
cd "$root" || exit 1
failed=0

# Check 1: library sources reading the environment.
getenv_calls=$(grep -rnE '\b(secure_)?getenv[[:space:]]*\(' aio cpu_adam swap engine \
  --include='*.cpp' --include='*.hpp' --include='*.h' --include='*.cc' --include='*.cu' \
  --include='*.cuh' 2>/dev/null)
if [[ -n $getenv_calls ]]; then
  echo "library sources that read the environment (pass the setting as an argument instead):"
  echo "$getenv_calls"
  failed=1
fi

# Check 2: machine-specific absolute paths in tracked files. A path must start the word
# (so a URL or a relative path with such a component does not count), the home directory
# must be followed by a user name and root's by a slash (so prose naming the root user does
# not). Each name is written with a bracket expression so this file does not match itself.
if ! git rev-parse --is-inside-work-tree > /dev/null 2>&1; then
  if ((failed)); then exit 1; fi
  echo "SKIP: $root is not a git checkout; tracked files cannot be listed"
  exit 77
fi
pattern='(^|[^[:alnum:]_.~/-]|//)(/hom[e]/[a-z_][a-z0-9_.-]*/|/roo[t]/|/wor[k]/|/User[s]/)'
paths=$(git grep -nIE "$pattern" -- ':/')
if [[ -n $paths ]]; then
  echo "tracked files with an absolute path of one machine's home or work directory:"
  echo "$paths"
  failed=1
fi
exit "$failed"
