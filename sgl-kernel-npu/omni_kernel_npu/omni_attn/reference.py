"""PyTorch references for sink + recent decode and extend attention over SGLang's paged KV.

Deliberately simple (one request at a time, fp32 math, explicit gather) so that it is obviously
right; the Triton kernel is tested against it.
"""

from __future__ import annotations

import math

import torch

from .indices import check_window, full_window, kept_positions, sink_recent_mask


def _soft_cap(scores: torch.Tensor, logit_cap: float) -> torch.Tensor:
    """SGLang's logit cap: ``cap * tanh(s / cap)``, off when ``cap <= 0``."""
    return logit_cap * torch.tanh(scores / logit_cap) if logit_cap > 0 else scores


def attend_slots(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                 slots: torch.Tensor, sm_scale: float, logit_cap: float = 0.0,
                 mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of queries ``q`` (``[t, num_q_heads, head_dim]``) over the KV at ``slots``;
    ``mask`` (``[t, len(slots)]`` bool) says which keys each query reads, all when None.

    Returns fp32 ``[t, num_q_heads, head_dim_v]``; zeros when ``slots`` is empty (a padded row).
    """
    t, num_q_heads = q.shape[0], q.shape[1]
    num_kv_heads, dv = v_buffer.shape[1], v_buffer.shape[2]
    if slots.numel() == 0:
        return torch.zeros(t, num_q_heads, dv, dtype=torch.float32, device=q.device)
    group = num_q_heads // num_kv_heads
    k = k_buffer[slots].float()  # [n, Hkv, Dk]
    v = v_buffer[slots].float()  # [n, Hkv, Dv]
    qg = q.float().view(t, num_kv_heads, group, -1)
    scores = _soft_cap(torch.einsum("thgd,nhd->thgn", qg, k) * sm_scale, logit_cap)
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("thgn,nhd->thgd", probs, v).reshape(t, num_q_heads, dv)


def _scale(q: torch.Tensor, sm_scale: float | None) -> float:
    """The kernels' default softmax scale, ``1 / sqrt(head_dim)``."""
    return 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale


def decode_sink_recent_reference(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                                 req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                                 seq_lens: torch.Tensor, sink: int, recent: int,
                                 sm_scale: float | None = None, logit_cap: float = 0.0
                                 ) -> torch.Tensor:
    """fp32 [batch, num_q_heads, head_dim_v] attention over each request's kept tokens."""
    check_window(sink, recent)
    scale = _scale(q, sm_scale)
    out = []
    for b in range(q.shape[0]):
        pos = kept_positions(int(seq_lens[b]), sink, recent, device=req_to_token.device)
        slots = req_to_token[int(req_pool_indices[b]), pos].long()
        out.append(attend_slots(q[b : b + 1], k_buffer, v_buffer, slots, scale, logit_cap)[0])
    return torch.stack(out)


def decode_full_reference(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                          req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                          seq_lens: torch.Tensor, sm_scale: float | None = None,
                          logit_cap: float = 0.0) -> torch.Tensor:
    """Ordinary decode attention over every token, for the short-sequence equality checks."""
    return decode_sink_recent_reference(q, k_buffer, v_buffer, req_to_token, req_pool_indices,
                                        seq_lens, *full_window(req_to_token), sm_scale=sm_scale,
                                        logit_cap=logit_cap)


def extend_sink_recent_reference(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                                 req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                                 seq_lens: torch.Tensor, qo_indptr: torch.Tensor, sink: int,
                                 recent: int, sm_scale: float | None = None,
                                 logit_cap: float = 0.0) -> torch.Tensor:
    """fp32 ``[num_tokens, num_q_heads, head_dim_v]`` extend attention with a dense mask.

    Request ``b``'s queries are rows ``qo_indptr[b]:qo_indptr[b + 1]`` at the last positions of
    its ``seq_lens[b]`` tokens; each reads the keys :func:`sink_recent_mask` allows. Rows that
    belong to no request stay zero.
    """
    check_window(sink, recent)
    scale = _scale(q, sm_scale)
    out = torch.zeros(q.shape[0], q.shape[1], v_buffer.shape[2], dtype=torch.float32,
                      device=q.device)
    for b in range(seq_lens.shape[0]):
        lo, hi = int(qo_indptr[b]), int(qo_indptr[b + 1])
        length = int(seq_lens[b])
        if hi == lo:
            continue
        slots = req_to_token[int(req_pool_indices[b]), :length].long()
        mask = sink_recent_mask(length - (hi - lo), length, sink, recent, device=q.device)
        out[lo:hi] = attend_slots(q[lo:hi], k_buffer, v_buffer, slots, scale, logit_cap, mask)
    return out
