"""Decide, cheaply and without importing torch, whether the CPU support must switch on."""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os

# Set to 0 to keep an installed sgl_kernel CPU build (AMX machines) instead of the import shim.
KERNEL_SHIM_ENV = "OMNIINFER_CPU_KERNEL_SHIM"


@functools.cache
def _cuda_driver_loadable() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def _npu_present() -> bool:
    return importlib.util.find_spec("torch_npu") is not None


def cpu_engine_active(environ: dict[str, str] | os._Environ[str] | None = None) -> bool:
    """True when SGLang was asked to run on the CPU and there is no accelerator stack."""
    env = os.environ if environ is None else environ
    if env.get("SGLANG_USE_CPU_ENGINE") != "1":
        return False
    return not _cuda_driver_loadable() and not _npu_present()


def kernel_shim_wanted(environ: dict[str, str] | os._Environ[str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return cpu_engine_active(env) and env.get(KERNEL_SHIM_ENV, "1") != "0"
