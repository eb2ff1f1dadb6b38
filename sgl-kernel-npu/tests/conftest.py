"""Run the kernels under the Triton interpreter on CPU unless told otherwise.

The interpreter is chosen when a kernel is defined, so the variable is set here, before any
test module imports the kernel module. ``TRITON_INTERPRET=0`` on a CUDA machine runs the same
tests compiled on the GPU instead.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
# Importable from a plain checkout, without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@pytest.fixture(scope="session")
def device() -> str:
    """CPU tensors under the interpreter, the GPU when compiling for CUDA."""
    if os.environ["TRITON_INTERPRET"].lower() not in ("0", "false", "off"):
        return "cpu"
    if not torch.cuda.is_available():
        pytest.skip("TRITON_INTERPRET=0 needs a CUDA device")
    return "cuda"
