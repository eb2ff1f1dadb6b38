"""The kernels' own test suite (sgl-kernel-npu/tests), run in a subprocess under the Triton
interpreter by this folder's test modules."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "sgl-kernel-npu"

KERNEL_TEST_FILES = sorted(path.name for path in (PKG / "tests").glob("test_*.py"))
DEVICE_CHECK_TESTS = "test_device_check_dry_run.py"  # run by test_kernels_device_check.py


def run_kernel_tests(names: list[str]) -> None:
    """The kernels' own tests ``names`` (files of sgl-kernel-npu/tests) pass in a subprocess
    under the Triton interpreter. Two modules call it, so that a parallel run spreads them."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    files = [str(PKG / "tests" / name) for name in names]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", *files],
        cwd=PKG, env=env, capture_output=True, text=True, timeout=600,
    )
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and " failed" not in proc.stdout, tail
