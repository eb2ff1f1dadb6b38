"""Runs at interpreter start (from the omniinfer_cpu.pth file) in every Python process.

It must be cheap and silent: it reads one environment variable and returns unless the CPU
engine is requested on a machine without CUDA or an NPU. Then it installs the import shims
before any SGLang module is imported (SGLang's worker processes import sgl_kernel long before
they load plugins).
"""

from __future__ import annotations

import os


def run() -> None:
    if os.environ.get("SGLANG_USE_CPU_ENGINE") != "1":
        return
    try:
        from omniinfer.cpu.detect import kernel_shim_wanted

        if kernel_shim_wanted():
            from omniinfer.cpu import import_shims

            import_shims.install()
    except Exception as exc:  # never break interpreter start-up
        import sys

        print(f"omniinfer: CPU start-up hook failed: {exc}", file=sys.stderr)
