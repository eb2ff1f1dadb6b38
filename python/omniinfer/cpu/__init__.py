"""CPU support for the real SGLang engine on machines without CUDA or an NPU.

Active only when ``SGLANG_USE_CPU_ENGINE=1`` is set and neither a CUDA driver nor torch_npu is
present. See docs/cpu.md.
"""

from omniinfer.cpu.detect import cpu_engine_active

__all__ = ["cpu_engine_active"]
