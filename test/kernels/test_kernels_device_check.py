"""sgl-kernel-npu's device check (``benchmarks/device_check.py``) in its dry run, under the
Triton interpreter: its own test file, in a module of its own so that a parallel run can give it
a worker while the kernel tests (``test_kernels_sink_recent.py``) run on another."""

from __future__ import annotations

from kernel_suite import DEVICE_CHECK_TESTS, run_kernel_tests


def test_device_check_dry_run_passes_in_interpreter() -> None:
    run_kernel_tests([DEVICE_CHECK_TESTS])
