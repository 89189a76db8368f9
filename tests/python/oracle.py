"""What a Python test does when its oracle (PyTorch for /usr/bin/python3) cannot run: exit 77,
which ctest shows as a skip, or, when OUTCORE_REQUIRE_ORACLES=1 (CI: ./dev.sh test), exit 1,
a failure. The Python twin of tests/common/oracle_unavailable.hpp. Also puts the built package
first on sys.path when OUTCORE_PYTHON_DIR names it (ctest sets it)."""
import os
import sys

SKIP_EXIT_CODE = 77


def oracles_required():
    return os.environ.get("OUTCORE_REQUIRE_ORACLES") == "1"


def unavailable(reason):
    if oracles_required():
        print(f"FAIL: oracle unavailable: {reason} (OUTCORE_REQUIRE_ORACLES=1 requires every "
              "oracle)", file=sys.stderr)
        sys.exit(1)
    print(f"SKIP: {reason}", file=sys.stderr)
    sys.exit(SKIP_EXIT_CODE)


def import_torch_and_outcore():
    """(torch, outcore), or ends the process as unavailable() says when torch is missing."""
    package_dir = os.environ.get("OUTCORE_PYTHON_DIR")
    if package_dir:
        sys.path.insert(0, package_dir)
    try:
        import torch
    except ImportError as e:
        unavailable(f"PyTorch is not importable by {sys.executable}: {e}")
    import outcore
    return torch, outcore
