#!/usr/bin/env python3
"""Names in the docs and comments that must exist: check_docs.py SOURCE_DIR

  1. Every test named as Suite.Name (or Suite.Prefix* / Suite.Prefix...) in a tracked Markdown
     file, source comment or script, whose Suite is a test suite of this repository, names a
     test that exists: TEST/TEST_F/TEST_P in the sources, or an add_test NAME in CMake. In
     backticks the suite must exist too (`Suite.Name`, `Suite.*`): a renamed suite is caught.
  2. Every repository path in backticks (`engine/zero/plan.cpp`, `tests/ckpt/`) whose first
     component is a top-level directory exists (a module named without its extension, such as
     `common/cleanup`, counts when its .hpp/.cpp/.cu/.py/.sh exists).

Prints each stale name as FILE:LINE: WHAT and exits 1; exits 0 when clean, 77 (a skip) when
SOURCE_DIR is not a git checkout.
"""
import os
import re
import subprocess
import sys

TEST_DEF = re.compile(r"\bTEST(?:_F|_P)?\(\s*(\w+)\s*,\s*(\w+)\s*\)")
CTEST_NAME = re.compile(r"\badd_test\(\s*NAME\s+([\w.]+)")
# Suite.Name with an optional * or ... prefix marker; not part of a longer dotted or path name,
# and not a name wrapped over two lines with a hyphen.
TEST_REF = re.compile(r"(?<![\w/.])([A-Z][A-Za-z0-9]+)\.([A-Z][A-Za-z0-9_]*)(\*|\.\.\.|-$)?(?![\w(])")
# `Suite.*`: every test of a suite.
SUITE_REF = re.compile(r"`([A-Z][A-Za-z0-9]+)\.\*`")
PATH_REF = re.compile(r"`([A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.-]+)+/?)`")
SELF = "tests/hygiene/check_docs.py"  # its own examples name no test
MODULE_EXTS = ("", ".hpp", ".cpp", ".cu", ".py", ".sh", ".md")


def quoted(line: str, m: re.Match) -> bool:
    """Whether the match opens a backticked span: `Suite.Name...`."""
    return m.start() > 0 and line[m.start() - 1] == "`"


def main() -> int:
    root = sys.argv[1]
    os.chdir(root)
    listed = subprocess.run(["git", "ls-files"], capture_output=True, text=True)
    if listed.returncode != 0:
        print(f"SKIP: {root} is not a git checkout; tracked files cannot be listed")
        return 77
    files = listed.stdout.split("\n")
    files = [f for f in files if f and os.path.isfile(f)]

    def text(f: str) -> str:
        with open(f, encoding="utf-8", errors="replace") as fh:
            return fh.read()

    tests = set()
    for f in files:
        if re.search(r"\.(cpp|hpp|cu|h|cc)$", f):
            tests.update(f"{a}.{b}" for a, b in TEST_DEF.findall(text(f)))
        elif f.endswith("CMakeLists.txt") or f.endswith(".cmake"):
            tests.update(CTEST_NAME.findall(text(f)))
    suites = {t.split(".")[0] for t in tests}
    top = {f.split("/")[0] for f in files if "/" in f}

    stale = []
    for f in files:
        if not re.search(r"\.(md|cpp|hpp|cu|h|cc|sh|py|txt|cmake)$", f) or f.endswith(SELF):
            continue
        for i, line in enumerate(text(f).split("\n"), 1):
            for m in TEST_REF.finditer(line):
                suite, name, mark = m.group(1), m.group(2), m.group(3)
                if mark == "-" or (suite not in suites and not quoted(line, m)):
                    continue
                full = f"{suite}.{name}"
                if mark in ("*", "..."):
                    found = any(t.startswith(full) for t in tests)
                else:
                    found = full in tests
                if not found:
                    stale.append(f"{f}:{i}: no test {full}{mark or ''}")
            for m in SUITE_REF.finditer(line):
                if m.group(1) not in suites:
                    stale.append(f"{f}:{i}: no test suite {m.group(1)}")
            for m in PATH_REF.finditer(line):
                p = m.group(1).rstrip("/")
                if p.split("/")[0] not in top:
                    continue
                if not any(os.path.exists(p + ext) for ext in MODULE_EXTS):
                    stale.append(f"{f}:{i}: no file {m.group(1)}")
    if stale:
        print("names of tests or files that do not exist (renamed or removed?):")
        print("\n".join(stale))
        return 1
    print(f"{len(tests)} tests and the repository's paths: every name in the docs exists")
    return 0


if __name__ == "__main__":
    sys.exit(main())
