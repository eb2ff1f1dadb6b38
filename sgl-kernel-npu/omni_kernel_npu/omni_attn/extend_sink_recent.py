"""Triton extend (prefill) attention for OmniAttn compressed layers over SGLang's paged KV.

A request with ``prefix_len`` cached tokens and ``extend_len`` new ones has queries at positions
``i in [prefix_len, seq_len)``. In a compressed layer query ``i`` reads key ``j`` when

    j <= i  and  (j < sink  or  j > i - recent)

(causal; the first ``sink`` tokens plus the last ``recent`` tokens counting itself), the same
rule as the decode kernel's kept set for the last query and as ``omniinfer.attn.masks``. Every
key, prefix or new, is read through ``req_to_token`` (one slot per token, so any page size);
the new tokens' K/V must already be written to the pool, as SGLang's backends do before
attention.

One program handles ``BLOCK_M`` consecutive queries of one request and one q head. It visits
only key blocks that can be unmasked for some query of the block: ``[0, min(sink, w_lo))`` and
``[w_lo, last query + 1)`` with ``w_lo = first query - recent + 1``, so a compressed layer costs
``O(sink + recent + BLOCK_M)`` keys per query block instead of ``O(seq_len)``.

Portability: the same subset as :mod:`.decode_sink_recent` (masked loads/stores and gathers,
``tl.where``/``tl.exp``/``tl.log``/``tl.max``/``tl.sum``, casts, ``range`` loops with runtime
bounds, constexpr power-of-two blocks, no early return). ``tl.dot`` is used only for fp16/bf16
with every dimension >= 16; fp32 inputs take a broadcast-multiply-sum path (CUDA would run an
fp32 ``tl.dot`` as TF32), with both sums over the last axis: Triton's combine pass rewrites a
sum over the middle axis of ``a[:, :, None] * b[None, :, :]`` into a ``tt.dot`` (TF32 again;
seen on the H200 as a 2e-3 error before the PV product was transposed).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl

from .decode_sink_recent import (
    _check_layout,
    _head_dims,
    _interpreting,
    _map_slot,
    _remember,
    _soft_cap,
    check_slot_map,
)
from .indices import check_window, full_window

DEFAULT_BLOCK_M = 64  # queries per program (16-bit inputs)
DEFAULT_BLOCK_N = 64  # keys per inner step (16-bit inputs)
FP32_BLOCK = 16  # both blocks for fp32: the broadcast path holds [M, N, D] in registers


@triton.jit
def _key_block(
    q, acc, m_i, l_i, start, end, qpos, q_valid, row, SlotMap, K, V, kvh, sink, recent,
    sm_scale, logit_cap, stride_kn, stride_kh, stride_vn, stride_vh, offs_dk, offs_dv, mask_dk,
    mask_dv, BLOCK_N: tl.constexpr, HAS_CAP: tl.constexpr, USE_DOT: tl.constexpr,
    DOT_FP32: tl.constexpr, HAS_MAP: tl.constexpr,
):
    """Online-softmax update of one query block with keys ``[start, min(start + BLOCK_N,
    end))``; masked entries (window rule, causality, padding) weigh zero."""
    j = start + tl.arange(0, BLOCK_N)
    k_valid = j < end
    slot = _map_slot(tl.load(row + j, mask=k_valid, other=0).to(tl.int64), SlotMap, k_valid,
                     HAS_MAP)
    keep = (j[None, :] <= qpos[:, None]) & (
        (j[None, :] < sink) | (j[None, :] > qpos[:, None] - recent))
    keep = keep & k_valid[None, :] & q_valid[:, None]
    if USE_DOT:
        k = tl.load(K + slot[None, :] * stride_kn + kvh * stride_kh + offs_dk[:, None],
                    mask=mask_dk[:, None] & k_valid[None, :], other=0.0)
        if DOT_FP32:
            s = tl.dot(q.to(tl.float32), k.to(tl.float32))
        else:
            s = tl.dot(q, k.to(q.dtype))
    else:
        k = tl.load(K + slot[:, None] * stride_kn + kvh * stride_kh + offs_dk[None, :],
                    mask=k_valid[:, None] & mask_dk[None, :], other=0.0).to(tl.float32)
        s = tl.sum(q.to(tl.float32)[:, None, :] * k[None, :, :], 2)
    s = s * sm_scale
    if HAS_CAP:
        s = _soft_cap(s, logit_cap)
    s = tl.where(keep, s, -float("inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row with nothing kept so far stays at -inf; subtract 0 there so no inf - inf appears.
    m_ref = tl.where(m_new > -float("inf"), m_new, 0.0)
    alpha = tl.exp(m_i - m_ref)
    p = tl.exp(s - m_ref[:, None])
    if USE_DOT:
        v = tl.load(V + slot[:, None] * stride_vn + kvh * stride_vh + offs_dv[None, :],
                    mask=k_valid[:, None] & mask_dv[None, :], other=0.0)
        if DOT_FP32:
            pv = tl.dot(p, v.to(tl.float32))
        else:
            pv = tl.dot(p.to(v.dtype), v)
    else:
        # V transposed, reduced over the last axis: Triton's combiner turns a reduction over
        # the middle axis of a broadcast product into tt.dot, which CUDA runs as TF32.
        vt = tl.load(V + slot[None, :] * stride_vn + kvh * stride_vh + offs_dv[:, None],
                     mask=mask_dv[:, None] & k_valid[None, :], other=0.0).to(tl.float32)
        pv = tl.sum(p[:, None, :] * vt[None, :, :], 2)
    acc = acc * alpha[:, None] + pv
    l_i = l_i * alpha + tl.sum(p, 1)
    return acc, m_new, l_i


@triton.jit
def _extend_kernel(
    Q, K, V, Out, QoIndptr, SeqLens, ReqPoolIdx, ReqToToken, SlotMap,
    sm_scale, logit_cap, sink, recent,
    stride_qt, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_ot, stride_oh,
    stride_r2t,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr, HAS_CAP: tl.constexpr, USE_DOT: tl.constexpr,
    DOT_FP32: tl.constexpr, HAS_MAP: tl.constexpr,
):
    """One (request, q head, query block) per program.

    Programs past a request's last query keep empty loop ranges and store nothing, instead of
    returning early (no data-dependent control flow beyond loop bounds).
    """
    b = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    kvh = h // GROUP
    q_start = tl.load(QoIndptr + b).to(tl.int32)
    n_new = tl.load(QoIndptr + b + 1).to(tl.int32) - q_start
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    prefix = seq_len - n_new
    row = ReqToToken + tl.load(ReqPoolIdx + b).to(tl.int64) * stride_r2t

    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    q_valid = offs_m < n_new
    qpos = prefix + offs_m
    offs_dk, offs_dv, mask_dk, mask_dv = _head_dims(DK, DV, BLOCK_DK, BLOCK_DV)
    tok = (q_start + offs_m).to(tl.int64)
    q = tl.load(Q + tok[:, None] * stride_qt + h * stride_qh + offs_dk[None, :],
                mask=q_valid[:, None] & mask_dk[None, :], other=0.0)

    # Key ranges any query of this block can read; both empty when the block has no query.
    n_q = tl.maximum(tl.minimum(n_new - mb * BLOCK_M, BLOCK_M), 0)
    first = prefix + mb * BLOCK_M
    w_hi = tl.where(n_q > 0, first + n_q, 0)
    w_lo = tl.minimum(tl.maximum(first - recent + 1, 0), w_hi)
    s_hi = tl.minimum(sink, w_lo)

    m_i = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for start in range(0, s_hi, BLOCK_N):  # sink keys below the window
        acc, m_i, l_i = _key_block(
            q, acc, m_i, l_i, start, s_hi, qpos, q_valid, row, SlotMap, K, V, kvh, sink,
            recent, sm_scale, logit_cap, stride_kn, stride_kh, stride_vn, stride_vh, offs_dk,
            offs_dv, mask_dk, mask_dv, BLOCK_N, HAS_CAP, USE_DOT, DOT_FP32, HAS_MAP)
    for start in range(w_lo, w_hi, BLOCK_N):  # the window, causal part included
        acc, m_i, l_i = _key_block(
            q, acc, m_i, l_i, start, w_hi, qpos, q_valid, row, SlotMap, K, V, kvh, sink,
            recent, sm_scale, logit_cap, stride_kn, stride_kh, stride_vn, stride_vh, offs_dk,
            offs_dv, mask_dk, mask_dv, BLOCK_N, HAS_CAP, USE_DOT, DOT_FP32, HAS_MAP)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(Out + tok[:, None] * stride_ot + h * stride_oh + offs_dv[None, :],
             out.to(Out.dtype.element_ty), mask=q_valid[:, None] & mask_dv[None, :])


def extend_sink_recent(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    qo_indptr: torch.Tensor,
    sink: int,
    recent: int,
    *,
    max_extend_len: int | None = None,
    sm_scale: float | None = None,
    logit_cap: float = 0.0,
    block_m: int | None = None,
    block_n: int | None = None,
    out: torch.Tensor | None = None,
    slot_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """Extend attention of each request's new tokens over its sink + recent keys.

    ``q`` is ``[total_new_tokens, num_q_heads, head_dim]``, request ``b``'s queries being rows
    ``qo_indptr[b]:qo_indptr[b + 1]`` (SGLang's ``extend_start_loc`` and ``extend_seq_lens``
    as an indptr); ``seq_lens`` counts prefix plus new tokens, all of whose K/V are in the pool.
    ``max_extend_len`` bounds the new tokens of any request and sizes the grid; without it the
    wrapper reads it from ``qo_indptr`` (one host sync). Rows of ``q`` that belong to no
    request are left untouched in ``out``. ``sink=0, recent >= seq_len`` is ordinary causal
    attention. ``slot_map`` translates slots as in
    :func:`~.decode_sink_recent.decode_sink_recent` (hybrid pools: full -> SWA).
    Returns ``[total_new_tokens, num_q_heads, head_dim_v]`` in ``q.dtype``.
    """
    check_window(sink, recent)
    check_slot_map(slot_map)
    group = _check_layout(q, k_buffer, v_buffer)
    if req_to_token.dim() != 2:
        raise ValueError("req_to_token must be [num_reqs, max_context]")
    num_tokens, num_q_heads, dk = q.shape
    dv = v_buffer.shape[2]
    batch = seq_lens.shape[0]
    if qo_indptr.shape[0] != batch + 1:
        raise ValueError("qo_indptr must have batch + 1 entries")
    use_dot = q.dtype in (torch.float16, torch.bfloat16)
    bm = block_m or (DEFAULT_BLOCK_M if use_dot else FP32_BLOCK)
    bn = block_n or (DEFAULT_BLOCK_N if use_dot else FP32_BLOCK)
    for name, size in (("block_m", bm), ("block_n", bn)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name} must be a power of two >= 16")
    if max_extend_len is None:
        max_extend_len = int((qo_indptr[1:] - qo_indptr[:-1]).max().item()) if batch else 0
    scale = 1.0 / math.sqrt(dk) if sm_scale is None else float(sm_scale)
    if out is None:
        out = q.new_empty(num_tokens, num_q_heads, dv)
    elif out.shape != (num_tokens, num_q_heads, dv) or out.stride(2) != 1:
        raise ValueError(f"out must be [{num_tokens}, {num_q_heads}, {dv}], last dim contiguous")
    if batch == 0 or max_extend_len <= 0:
        return out
    grid = (batch, num_q_heads, triton.cdiv(max_extend_len, bm))
    handle = _extend_kernel[grid](
        q, k_buffer, v_buffer, out, qo_indptr, seq_lens, req_pool_indices, req_to_token,
        slot_map if slot_map is not None else seq_lens, scale, float(logit_cap), int(sink),
        int(recent),
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), out.stride(0), out.stride(1),
        req_to_token.stride(0),
        GROUP=group, DK=dk, DV=dv, BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_DK=max(16, triton.next_power_of_2(dk)), BLOCK_DV=max(16, triton.next_power_of_2(dv)),
        HAS_CAP=logit_cap > 0, USE_DOT=use_dot,
        DOT_FP32=q.dtype == torch.bfloat16 and _interpreting(), HAS_MAP=slot_map is not None,
        num_warps=4 if use_dot else 8,
    )
    _remember("extend_dot" if use_dot else "extend_vector", handle)
    return out


def extend_full(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                qo_indptr: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """Causal extend attention over every key with the same kernel (``sink=0``,
    ``recent=max_context``): the full-layer baseline of the timings."""
    return extend_sink_recent(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens,
                              qo_indptr, *full_window(req_to_token), **kwargs)
