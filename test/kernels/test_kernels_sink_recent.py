"""sgl-kernel-npu's OmniAttn sink + recent decode kernel, checked on CPU in the Triton interpreter.

Triton picks interpreter mode when a kernel is defined, and this pytest process may already
hold triton in compiled mode (SGLang imports it), so the kernel tests run in a subprocess with
``TRITON_INTERPRET=1``. The torch-only reference is imported here from the installed package
(``scripts/setup.sh`` installs ``sgl-kernel-npu/`` in editable mode), which also checks that
importing the package does not need triton's mode settled.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import torch
from kernel_suite import DEVICE_CHECK_TESTS, KERNEL_TEST_FILES, PKG, run_kernel_tests


def _omni(name: str) -> ModuleType:
    return importlib.import_module(f"omni_kernel_npu.omni_attn.{name}")


def test_kernels_are_the_installed_package_of_this_repository() -> None:
    import omni_kernel_npu

    assert Path(omni_kernel_npu.__file__).resolve().is_relative_to(PKG.resolve())


def test_reference_keeps_sink_and_recent_window() -> None:
    indices, reference, testing = _omni("indices"), _omni("reference"), _omni("testing")
    assert indices.kept_positions(13, 4, 8).tolist() == [0, 1, 2, 3, *range(5, 13)]
    assert indices.kept_positions(3, 4, 8).tolist() == [0, 1, 2]
    inp = testing.make_paged_inputs([7, 12, 30], 4, 2, 16, max_context=32)
    out = reference.decode_sink_recent_reference(*inp.args(), 4, 8)
    full = reference.decode_full_reference(*inp.args())
    torch.testing.assert_close(out[:2], full[:2])  # short: nothing evicted
    assert (out[2] - full[2]).abs().max() > 1e-2  # long: the window changes the result


def test_the_kernel_test_files_are_found() -> None:
    assert {"test_decode_sink_recent.py", "test_extend_sink_recent.py",
            DEVICE_CHECK_TESTS} <= set(KERNEL_TEST_FILES)


def test_kernel_suite_passes_in_interpreter() -> None:
    run_kernel_tests([name for name in KERNEL_TEST_FILES if name != DEVICE_CHECK_TESTS])
