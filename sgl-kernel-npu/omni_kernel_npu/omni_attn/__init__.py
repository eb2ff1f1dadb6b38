"""OmniAttn kernels: decode attention that reads only a request's sink + recent tokens.

Kernels live in :mod:`omni_kernel_npu.omni_attn.decode_sink_recent` and are not imported here:
triton decides at kernel definition time whether to run in interpreter mode, so importing this
package (references, index helpers) must not define them.
"""

from __future__ import annotations

from .indices import build_kv_indices, kept_count, kept_positions
from .reference import decode_full_reference, decode_sink_recent_reference

__all__ = [
    "build_kv_indices", "kept_count", "kept_positions", "decode_full_reference",
    "decode_sink_recent_reference",
]
