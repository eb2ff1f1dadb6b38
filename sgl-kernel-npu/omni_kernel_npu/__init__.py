"""Triton kernels of OmniInfer that CUDA Triton and triton-ascend can both compile.

Importing the package does not import triton: kernel modules load on first use, so torch-only
pieces (references, index helpers) work anywhere and ``TRITON_INTERPRET`` can still be set
before the kernels are defined.
"""

__version__ = "0.1.0"
