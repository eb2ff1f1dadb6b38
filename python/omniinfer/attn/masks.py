"""Per-layer sink+recent attention as a transformers attention function.

transformers 5 calls one attention function per layer (``AttentionInterface``) and hands it the
layer module, so a function registered under :data:`IMPLEMENTATION` can decide per layer: full
causal attention, or in a compressed layer, query t sees keys [0, sink) and (t - recent, t],
exactly the keys a decoder that evicted the others would still hold. The per-layer windows
travel as the forward keyword ``omni_windows`` (a tuple with (sink, recent) or None per layer),
which transformers passes through to every attention call; the model stays unmodified.

The name is not registered as a mask function, so the model builds no mask of its own (it
gives None); this function builds what each layer needs from the key/query lengths, assuming
the keys are all tokens so far (a whole window, or a cache that keeps everything).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

IMPLEMENTATION = "omniattn_sink_recent"
# Queries per block in compressed layers: each block reads sink + recent + block keys only.
BLOCK = 256

Windows = tuple[tuple[int, int] | None, ...]


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return x
    b, h, n, d = x.shape
    return x[:, :, None].expand(b, h, groups, n, d).reshape(b, h * groups, n, d)


def window_mask(
    q_pos: torch.Tensor, k_pos: torch.Tensor, sink: int, recent: int
) -> torch.Tensor:
    """Boolean [q, k] mask: causal and (k < sink or k > q - recent)."""
    q, k = q_pos[:, None], k_pos[None, :]
    return (k <= q) & ((k < sink) | (k > q - recent))


def causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding: int | None) -> torch.Tensor:
    q, k = q_pos[:, None], k_pos[None, :]
    allowed = k <= q
    if sliding is not None:  # transformers' sliding layers: q - k < sliding_window
        allowed &= q - k < sliding
    return allowed


def sink_recent_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    sink: int,
    recent: int,
    scaling: float | None,
    block: int | None = None,
) -> torch.Tensor:
    """Attention of a compressed layer, in query blocks that read only the keys they may see.

    Shapes: query [b, h, q, d], key/value [b, h, k, d] (heads already expanded), the queries
    being the last q of the k positions. Returns [b, h, q, d].
    """
    q_len, k_len = query.shape[2], key.shape[2]
    offset, block = k_len - q_len, block or BLOCK
    device = query.device
    outputs = []
    for start in range(0, q_len, block):
        stop = min(start + block, q_len)
        first_q, last_q = offset + start, offset + stop - 1
        lo = max(sink, first_q - recent + 1)  # first recent key any query of the block sees
        recent_keys = torch.arange(lo, max(lo, last_q + 1), device=device)
        k_idx = torch.cat([torch.arange(min(sink, last_q + 1), device=device), recent_keys])
        q_pos = torch.arange(first_q, last_q + 1, device=device)
        mask = window_mask(q_pos, k_idx, sink, recent)
        outputs.append(
            F.scaled_dot_product_attention(
                query[:, :, start:stop],
                key[:, :, k_idx],
                value[:, :, k_idx],
                attn_mask=mask,
                scale=scaling,
            )
        )
    return torch.cat(outputs, dim=2)


def omni_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    omni_windows: Windows | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The registered attention function; ``omni_windows`` picks this layer's window."""
    if attention_mask is not None:
        raise ValueError(f"{IMPLEMENTATION} builds its own masks; pass no attention_mask")
    groups = query.shape[1] // key.shape[1]
    key, value = _expand_kv(key, groups), _expand_kv(value, groups)
    window = omni_windows[module.layer_idx] if omni_windows is not None else None
    q_len, k_len = query.shape[2], key.shape[2]
    if window is not None:
        if sliding_window is not None:
            raise ValueError(f"layer {module.layer_idx} is a sliding layer; cannot compress it")
        out = sink_recent_attention(query, key, value, window[0], window[1], scaling)
    elif sliding_window is None and q_len == k_len:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    else:
        q_pos = torch.arange(k_len - q_len, k_len, device=query.device)
        mask = causal_mask(q_pos, torch.arange(k_len, device=query.device), sliding_window)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Register the attention function with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, omni_attention_forward)
    return IMPLEMENTATION


def use(model: Any) -> None:
    """Switch a loaded transformers model to the per-layer sink+recent attention."""
    model.set_attn_implementation(register())


def windows_for(
    compressed: tuple[bool, ...] | list[bool], sink: int, recent: int
) -> Windows:
    return tuple((sink, recent) if c else None for c in compressed)
