"""A plain-PyTorch MoE expert computation that tolerates expert ids owned by another rank.

With expert parallelism, SGLang hands each rank top-k ids in its local expert numbering and
marks experts held elsewhere with -1. SGLang's native (non-kernel) MoE path indexes with those
ids directly and counts experts with ``scatter_`` (duplicates collapse), so it fails as soon as
EP > 1 on CPU. Here -1 entries contribute nothing and every (token, slot) pair is counted.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import functional as F


def _activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    def gated(act: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        def apply(gate_up: torch.Tensor) -> torch.Tensor:
            gate, up = gate_up.chunk(2, dim=-1)
            return act(gate) * up

        return apply

    if name == "silu":
        return gated(F.silu)
    if name == "gelu":
        return gated(F.gelu)
    raise NotImplementedError(f"masked CPU MoE: activation {name!r} is not supported")


def masked_moe_forward(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_weight: torch.Tensor,
    w2_weight: torch.Tensor,
    activation: str = "silu",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weighted sum over each token's selected local experts; ids < 0 are skipped.

    Shapes: x [T, H]; topk_* [T, K]; w13 [E, 2I, H]; w2 [E, H, I]. Returns [T, H] in x's dtype.
    """
    act = _activation(activation)
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1).to(torch.int64)
    flat_weights = topk_weights.reshape(-1)
    token_of_slot = torch.arange(num_tokens, device=x.device).repeat_interleave(top_k)
    out = torch.zeros(num_tokens, w2_weight.shape[1], dtype=torch.float32, device=x.device)
    local = flat_ids >= 0
    for expert in torch.unique(flat_ids[local]).tolist():
        slots = torch.nonzero(flat_ids == expert, as_tuple=True)[0]
        tokens = token_of_slot[slots]
        hidden = F.linear(x[tokens], w13_weight[expert])
        if w13_bias is not None:
            hidden = (hidden.float() + w13_bias[expert]).to(x.dtype)
        hidden = F.linear(act(hidden), w2_weight[expert])
        if w2_bias is not None:
            hidden = (hidden.float() + w2_bias[expert]).to(x.dtype)
        out.index_add_(0, tokens, hidden.float() * flat_weights[slots, None].float())
    return out.to(x.dtype)
