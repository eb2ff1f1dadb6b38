"""The few torch.cuda / torch.cpu calls SGLang makes unconditionally, made harmless on CPU.

SGLang's expert-distribution recorder and a few utilities call them through
``torch.get_device_module()``, which is ``torch.cuda`` on a CUDA wheel and ``torch.cpu`` on the
CPU wheel. Without a CUDA device they either raise or do not exist.
"""

from __future__ import annotations

from typing import Any


def _not_capturing() -> bool:
    return False


def _no_op(*_args: Any, **_kwargs: Any) -> None:
    return None


def patch_torch() -> list[str]:
    """Fill in the missing calls; returns the names it set (for logging)."""
    import torch

    if torch.cuda.is_available():
        return []
    patched = []
    for module, name in (
        (torch.cuda, "is_current_stream_capturing"),
        (torch.cpu, "is_current_stream_capturing"),
    ):
        setattr(module, name, _not_capturing)
        patched.append(f"{module.__name__}.{name}")
    torch.cuda.synchronize = _no_op
    patched.append("torch.cuda.synchronize")
    if not hasattr(torch.cpu, "empty_cache"):
        torch.cpu.empty_cache = _no_op
        patched.append("torch.cpu.empty_cache")
    return patched
