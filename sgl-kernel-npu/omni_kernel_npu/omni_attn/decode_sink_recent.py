"""Triton decode attention over SGLang's paged KV that reads only the sink + recent tokens.

OmniAttn compressed layers keep, for a request of length ``L``, the positions
``[0, min(sink, L)) ∪ [max(sink, L - recent), L)``. The kernels map a dense logical index
``j in [0, kept)`` onto those positions inside the kernel, then onto KV slots through SGLang's
``req_to_token`` table, so no index list is built per step and nothing syncs with the host.
A second entry point takes an explicit ``kv_indptr``/``kv_indices`` list (SGLang's Triton
backend convention) for callers that already build one.

Layout (SGLang, per layer): ``k_buffer``/``v_buffer`` are ``[num_slots, num_kv_heads, head_dim]``,
``req_to_token`` is ``[num_reqs, max_context]`` (position -> slot), ``q`` is
``[batch, num_q_heads, head_dim]`` with ``num_q_heads = group * num_kv_heads``.

Work is split flash-decoding style: stage 1 runs ``num_kv_splits`` programs per (request, head)
over consecutive chunks of the kept tokens and writes a normalized partial output plus its
log-sum-exp; stage 2 merges the partials.

Portability (CUDA Triton and triton-ascend): only ``tl.load``/``tl.store`` with masks,
``tl.arange``, ``tl.where``, ``tl.exp``/``tl.log``, ``tl.max``/``tl.sum``/``tl.maximum``/
``tl.minimum``, casts, plain ``range`` loops and ``tl.dot``; every block size is a constexpr
power of two; no inline asm, no ``tl.extra.cuda``/libdevice (core ``tl`` has no tanh, so the
logit cap is written with ``tl.exp``), no atomics, no block pointers or tensor descriptors, no
``num_stages``-dependent pipelining. ``tl.dot`` appears only in the grouped kernel, on 16-bit
inputs, with every dimension at least 16 (heads padded to ``BLOCK_H = 16``); the ``head``
kernel has no ``tl.dot`` at all.
"""

from __future__ import annotations

import math
import os
from typing import Any, Literal

import torch
import triton
import triton.language as tl

from .indices import check_window, full_window

Impl = Literal["auto", "head", "grouped"]

BLOCK_H = 16  # q heads per grouped program; tl.dot wants M >= 16 (Ascend cube, CUDA mma)
DEFAULT_BLOCK_N = 32  # kept tokens per inner step
MAX_KV_SPLITS = 16
TOKENS_PER_SPLIT = 256  # target chunk per split before the split count is capped

# Last compiled stage kernels by name (CUDA/Ascend only; None under the interpreter). The GPU
# check reads the compiled target and assembly kinds from here.
_LAST_COMPILED: dict[str, Any] = {}


def last_compiled() -> dict[str, Any]:
    """Compiled kernels of the latest launches, keyed by kernel name."""
    return dict(_LAST_COMPILED)


@triton.jit
def _soft_cap(s, cap):
    """``cap * tanh(s / cap)`` from ``tl.exp`` only: core ``tl`` has no tanh, and libdevice
    differs between CUDA and Ascend."""
    x = s / cap
    e = tl.exp(-2.0 * tl.where(x >= 0, x, -x))
    t = (1.0 - e) / (1.0 + e)
    return cap * tl.where(x >= 0, t, -t)


@triton.jit
def _map_slot(slot, SlotMap, valid, HAS_MAP: tl.constexpr):
    """Translate pool slots through ``SlotMap`` (SGLang's hybrid pool: ``req_to_token`` holds
    full-pool slots, a compressed layer's buffer is indexed by SWA slots)."""
    if HAS_MAP:
        slot = tl.load(SlotMap + slot, mask=valid, other=0).to(tl.int64)
    return slot


@triton.jit
def _split_window(b, split, SeqLens, ReqPoolIdx, ReqToToken, KvIndptr, KvIndices, stride_r2t,
                  sink, recent, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
                  INDEXED: tl.constexpr):
    """(slot-row pointer, sink count, first recent position, lo, hi) for request ``b``: this
    split reads logical indices ``[lo, hi)`` of the request's kept tokens.

    Logical index j maps to position ``j`` if ``j < n_sink`` else ``recent_start + j - n_sink``;
    with an explicit index list every entry is kept and ``n_sink = n_kept`` makes it identity.
    """
    if INDEXED:
        start = tl.load(KvIndptr + b)
        n_kept = tl.load(KvIndptr + b + 1) - start
        row = KvIndices + start.to(tl.int64)
        n_sink = n_kept
        recent_start = n_kept * 0
    else:
        seq_len = tl.load(SeqLens + b)
        row = ReqToToken + tl.load(ReqPoolIdx + b).to(tl.int64) * stride_r2t
        n_sink = tl.minimum(seq_len, sink)
        n_kept = tl.minimum(seq_len, sink + recent)
        recent_start = seq_len - (n_kept - n_sink)
    per_split = tl.cdiv(tl.cdiv(n_kept, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, n_kept)
    return row, n_sink, recent_start, lo, hi


@triton.jit
def _kept_slots(start, hi, row, n_sink, recent_start, SlotMap, BLOCK_N: tl.constexpr,
                HAS_MAP: tl.constexpr):
    """(pool slots, valid) of logical indices ``[start, start + BLOCK_N)`` below ``hi``."""
    j = start + tl.arange(0, BLOCK_N)
    valid = j < hi
    pos = tl.where(j < n_sink, j, recent_start + (j - n_sink))
    slot = _map_slot(tl.load(row + pos, mask=valid, other=0).to(tl.int64), SlotMap, valid,
                     HAS_MAP)
    return slot, valid


@triton.jit
def _head_dims(DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr,
               BLOCK_DV: tl.constexpr):
    """Offsets and masks over the K and V head dimensions, padded to powers of two."""
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    return offs_dk, offs_dv, offs_dk < DK, offs_dv < DV


@triton.jit
def _stage1_head(
    Q, K, V, SeqLens, ReqPoolIdx, ReqToToken, KvIndptr, KvIndices, SlotMap, MidO, MidLse,
    sm_scale, logit_cap, sink, recent,
    stride_qb, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_r2t,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, HAS_CAP: tl.constexpr, INDEXED: tl.constexpr,
    HAS_MAP: tl.constexpr,
):
    """One (request, q head, split) per program; vector ops only (no tl.dot)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    kvh = h // GROUP
    row, n_sink, recent_start, lo, hi = _split_window(
        b, split, SeqLens, ReqPoolIdx, ReqToToken, KvIndptr, KvIndices, stride_r2t, sink, recent,
        NUM_SPLITS, BLOCK_N, INDEXED)
    offs_dk, offs_dv, mask_dk, mask_dv = _head_dims(DK, DV, BLOCK_DK, BLOCK_DV)
    q = tl.load(Q + b.to(tl.int64) * stride_qb + h * stride_qh + offs_dk, mask=mask_dk,
                other=0.0).to(tl.float32)

    m_i = -float("inf")
    l_i = 0.0
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        slot, valid = _kept_slots(start, hi, row, n_sink, recent_start, SlotMap, BLOCK_N, HAS_MAP)
        k = tl.load(K + slot[:, None] * stride_kn + kvh * stride_kh + offs_dk[None, :],
                    mask=valid[:, None] & mask_dk[None, :], other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], 1) * sm_scale
        if HAS_CAP:
            s = _soft_cap(s, logit_cap)
        s = tl.where(valid, s, -float("inf"))
        v = tl.load(V + slot[:, None] * stride_vn + kvh * stride_vh + offs_dv[None, :],
                    mask=valid[:, None] & mask_dv[None, :], other=0.0).to(tl.float32)
        m_new = tl.maximum(m_i, tl.max(s, 0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        l_i = l_i * alpha + tl.sum(p, 0)
        m_i = m_new

    # An empty split (or an empty request) writes a zero partial with weight exp(-inf) = 0.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    base = b.to(tl.int64) * stride_mob + h * stride_moh + split * stride_mos
    tl.store(MidO + base + offs_dv, acc / l_safe, mask=mask_dv)
    lse = tl.where(l_i > 0, m_i + tl.log(l_safe), -float("inf"))
    tl.store(MidLse + b.to(tl.int64) * stride_mlb + h * stride_mlh + split, lse)


@triton.jit
def _stage1_grouped(
    Q, K, V, SeqLens, ReqPoolIdx, ReqToToken, KvIndptr, KvIndices, SlotMap, MidO, MidLse,
    sm_scale, logit_cap, sink, recent,
    stride_qb, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_r2t,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
    GROUP: tl.constexpr, HEADS_PER_TILE: tl.constexpr, TILES_PER_KV: tl.constexpr,
    DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_CAP: tl.constexpr,
    INDEXED: tl.constexpr, DOT_FP32: tl.constexpr, HAS_MAP: tl.constexpr,
):
    """One (request, kv head tile, split) per program: the q heads sharing a kv head read each
    K/V tile once and use tl.dot ([BLOCK_H, BLOCK_DK] x [BLOCK_DK, BLOCK_N], all >= 16).

    DOT_FP32 feeds tl.dot fp32 operands; only the interpreter needs it, because it multiplies
    the raw uint16 bit patterns of bf16 operands (triton-lang/triton#11584).
    """
    b = tl.program_id(0)
    pid_h = tl.program_id(1)
    split = tl.program_id(2)
    kvh = pid_h // TILES_PER_KV
    tile = pid_h % TILES_PER_KV
    row, n_sink, recent_start, lo, hi = _split_window(
        b, split, SeqLens, ReqPoolIdx, ReqToToken, KvIndptr, KvIndices, stride_r2t, sink, recent,
        NUM_SPLITS, BLOCK_N, INDEXED)
    offs_h = tl.arange(0, BLOCK_H)
    g = tile * HEADS_PER_TILE + offs_h
    mask_h = (offs_h < HEADS_PER_TILE) & (g < GROUP)
    heads = kvh * GROUP + g
    offs_dk, offs_dv, mask_dk, mask_dv = _head_dims(DK, DV, BLOCK_DK, BLOCK_DV)
    q = tl.load(Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_dk[None, :],
                mask=mask_h[:, None] & mask_dk[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        slot, valid = _kept_slots(start, hi, row, n_sink, recent_start, SlotMap, BLOCK_N, HAS_MAP)
        k = tl.load(K + slot[None, :] * stride_kn + kvh * stride_kh + offs_dk[:, None],
                    mask=mask_dk[:, None] & valid[None, :], other=0.0)
        if DOT_FP32:
            s = tl.dot(q.to(tl.float32), k.to(tl.float32)) * sm_scale
        else:
            s = tl.dot(q, k.to(q.dtype)) * sm_scale
        if HAS_CAP:
            s = _soft_cap(s, logit_cap)
        s = tl.where(valid[None, :], s, -float("inf"))
        v = tl.load(V + slot[:, None] * stride_vn + kvh * stride_vh + offs_dv[None, :],
                    mask=valid[:, None] & mask_dv[None, :], other=0.0)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        if DOT_FP32:
            pv = tl.dot(p, v.to(tl.float32))
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    base = b.to(tl.int64) * stride_mob + split * stride_mos
    tl.store(MidO + base + heads[:, None] * stride_moh + offs_dv[None, :],
             acc / l_safe[:, None], mask=mask_h[:, None] & mask_dv[None, :])
    lse = tl.where(l_i > 0, m_i + tl.log(l_safe), -float("inf"))
    tl.store(MidLse + b.to(tl.int64) * stride_mlb + heads * stride_mlh + split, lse, mask=mask_h)


@triton.jit
def _stage2_merge(
    MidO, MidLse, Out,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Merge the split partials of one (request, head) by their log-sum-exp weights."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < NUM_SPLITS
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < DV
    lse = tl.load(MidLse + b * stride_mlb + h * stride_mlh + offs_s, mask=mask_s,
                  other=-float("inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m > -float("inf"), m, 0.0)  # all splits empty: every weight is 0
    w = tl.exp(lse - m_safe)
    part = tl.load(MidO + b * stride_mob + h * stride_moh + offs_s[:, None] * stride_mos
                   + offs_dv[None, :], mask=mask_s[:, None] & mask_dv[None, :], other=0.0)
    num = tl.sum(w[:, None] * part, 0)
    den = tl.sum(w, 0)
    out = num / tl.where(den > 0, den, 1.0)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_dv, out.to(Out.dtype.element_ty),
             mask=mask_dv)


def _interpreting() -> bool:
    """Whether kernels run under TRITON_INTERPRET (triton-ascend 3.2 has no ``knobs``)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")


def default_num_kv_splits(max_kept: int) -> int:
    """Splits for a bound on kept tokens, from shapes only (no device sync, graph-safe)."""
    return max(1, min(MAX_KV_SPLITS, triton.cdiv(max(1, max_kept), TOKENS_PER_SPLIT)))


def _pick_impl(impl: Impl, q: torch.Tensor, group: int) -> str:
    if impl == "auto":
        wide = q.dtype in (torch.float16, torch.bfloat16) and group > 1
        return "grouped" if wide else "head"
    if impl == "grouped" and q.dtype not in (torch.float16, torch.bfloat16):
        # CUDA's tl.dot on fp32 defaults to TF32; keep fp32 exact by using the vector kernel.
        raise ValueError("impl='grouped' needs fp16/bf16 inputs; use 'head' for fp32")
    if impl not in ("head", "grouped"):
        raise ValueError(f"unknown impl {impl!r}")
    return impl


def _check_layout(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor) -> int:
    """Validate shapes/strides the kernels assume; returns the GQA group size."""
    if q.dim() != 3 or k_buffer.dim() != 3 or v_buffer.dim() != 3:
        raise ValueError("q, k_buffer, v_buffer must be 3-D [tokens|slots, heads, dim]")
    if k_buffer.shape[:2] != v_buffer.shape[:2] or q.shape[2] != k_buffer.shape[2]:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)} k {tuple(k_buffer.shape)} "
                         f"v {tuple(v_buffer.shape)}")
    num_q_heads, num_kv_heads = q.shape[1], k_buffer.shape[1]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} not a multiple of {num_kv_heads}")
    for name, t in (("q", q), ("k_buffer", k_buffer), ("v_buffer", v_buffer)):
        if t.stride(2) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim")
    return num_q_heads // num_kv_heads


def _launch(
    q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
    seq_lens: torch.Tensor | None, req_pool_indices: torch.Tensor | None,
    req_to_token: torch.Tensor | None, kv_indptr: torch.Tensor | None,
    kv_indices: torch.Tensor | None, sink: int, recent: int, max_kept: int,
    sm_scale: float | None, logit_cap: float, num_kv_splits: int | None, impl: Impl,
    block_n: int, out: torch.Tensor | None, slot_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """Shared host side of both entry points: buffers, grid, the two stage launches."""
    group = _check_layout(q, k_buffer, v_buffer)
    kind = _pick_impl(impl, q, group)
    batch, num_q_heads, dk = q.shape
    num_kv_heads, dv = v_buffer.shape[1], v_buffer.shape[2]
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError("block_n must be a power of two >= 16")
    splits = default_num_kv_splits(max_kept) if num_kv_splits is None else int(num_kv_splits)
    if splits < 1:
        raise ValueError("num_kv_splits must be >= 1")
    scale = 1.0 / math.sqrt(dk) if sm_scale is None else float(sm_scale)
    if out is None:
        out = q.new_empty(batch, num_q_heads, dv)
    elif out.shape != (batch, num_q_heads, dv) or out.stride(2) != 1:
        raise ValueError(f"out must be [{batch}, {num_q_heads}, {dv}], last dim contiguous")
    if batch == 0:
        return out
    mid_o = torch.empty(batch, num_q_heads, splits, dv, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(batch, num_q_heads, splits, dtype=torch.float32, device=q.device)
    indexed = kv_indptr is not None
    # Unused pointer arguments still need a tensor; the constexpr branch never touches them.
    dummy = kv_indptr if indexed else seq_lens
    seq_lens_t = seq_lens if seq_lens is not None else dummy
    pool_t = req_pool_indices if req_pool_indices is not None else dummy
    r2t = req_to_token if req_to_token is not None else dummy
    indptr_t = kv_indptr if indexed else dummy
    indices_t = kv_indices if indexed else dummy
    map_t = slot_map if slot_map is not None else dummy
    stride_r2t = req_to_token.stride(0) if req_to_token is not None else 0
    block_dk = max(16, triton.next_power_of_2(dk))
    block_dv = max(16, triton.next_power_of_2(dv))
    common = (
        q, k_buffer, v_buffer, seq_lens_t, pool_t, r2t, indptr_t, indices_t, map_t, mid_o,
        mid_lse,
        scale, float(logit_cap), int(sink), int(recent),
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), stride_r2t,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
    )
    flags = dict(HAS_CAP=logit_cap > 0, INDEXED=indexed, HAS_MAP=slot_map is not None)
    if kind == "head":
        handle = _stage1_head[(batch, num_q_heads, splits)](
            *common, GROUP=group, DK=dk, DV=dv, BLOCK_DK=block_dk, BLOCK_DV=block_dv,
            BLOCK_N=block_n, NUM_SPLITS=splits, **flags, num_warps=4 if group == 1 else 2,
        )
    else:
        per_tile = min(BLOCK_H, group)
        tiles = triton.cdiv(group, per_tile)
        handle = _stage1_grouped[(batch, num_kv_heads * tiles, splits)](
            *common, GROUP=group, HEADS_PER_TILE=per_tile, TILES_PER_KV=tiles, DK=dk, DV=dv,
            BLOCK_H=BLOCK_H, BLOCK_DK=block_dk, BLOCK_DV=block_dv, BLOCK_N=block_n,
            NUM_SPLITS=splits, **flags, DOT_FP32=q.dtype == torch.bfloat16 and _interpreting(),
            num_warps=4,
        )
    variant = "_indexed" if indexed else ""
    _remember(f"stage1_{kind}{variant}", handle)
    handle = _stage2_merge[(batch, num_q_heads)](
        mid_o, mid_lse, out,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        DV=dv, BLOCK_DV=block_dv, NUM_SPLITS=splits,
        BLOCK_S=max(2, triton.next_power_of_2(splits)), num_warps=4,
    )
    _remember("stage2_merge", handle)
    return out


def _remember(name: str, handle: Any) -> None:
    if handle is not None:
        _LAST_COMPILED[name] = handle


def decode_sink_recent(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sink: int,
    recent: int,
    *,
    sm_scale: float | None = None,
    logit_cap: float = 0.0,
    num_kv_splits: int | None = None,
    impl: Impl = "auto",
    block_n: int = DEFAULT_BLOCK_N,
    out: torch.Tensor | None = None,
    slot_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of each request over its first ``sink`` and last ``recent`` tokens.

    ``seq_lens`` counts the current token, whose K/V must already be in the cache. Sequences
    with ``seq_len <= sink + recent`` get exact full attention; ``seq_len == 0`` gives zeros.
    ``sink=0, recent=req_to_token.shape[1]`` is ordinary full decode attention. No host sync:
    the split count comes from ``min(sink + recent, max_context)`` unless given.
    ``slot_map`` (1-D, int32/int64), when given, translates every slot read from
    ``req_to_token`` before K/V are indexed: pass SGLang's ``full_to_swa_index_mapping`` to
    serve a compressed layer from the SWA sub-pool of a hybrid pool.
    Returns ``[batch, num_q_heads, head_dim_v]`` in ``q.dtype`` (or writes ``out``).
    """
    check_window(sink, recent)
    if req_to_token.dim() != 2:
        raise ValueError("req_to_token must be [num_reqs, max_context]")
    check_slot_map(slot_map)
    max_kept = min(sink + recent, req_to_token.shape[1])
    return _launch(q, k_buffer, v_buffer, seq_lens, req_pool_indices, req_to_token, None,
                   None, sink, recent, max_kept, sm_scale, logit_cap, num_kv_splits, impl,
                   block_n, out, slot_map)


def check_slot_map(slot_map: torch.Tensor | None) -> None:
    """A slot map is a 1-D integer table indexed by pool slot."""
    if slot_map is not None and (slot_map.dim() != 1 or slot_map.dtype not in (torch.int32,
                                                                               torch.int64)):
        raise ValueError("slot_map must be a 1-D int32/int64 tensor")


def decode_paged_indices(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    *,
    max_kept: int | None = None,
    sm_scale: float | None = None,
    logit_cap: float = 0.0,
    num_kv_splits: int | None = None,
    impl: Impl = "auto",
    block_n: int = DEFAULT_BLOCK_N,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention over an explicit slot list per request (SGLang's Triton convention).

    ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]`` are request ``b``'s slots, e.g. from
    :func:`omni_kernel_npu.omni_attn.indices.build_kv_indices`. ``max_kept`` (an upper bound on
    a request's list length) sizes the default split count; without it the count comes from
    ``kv_indices.numel()``, which over-splits but stays correct and sync-free.
    """
    bound = kv_indices.numel() if max_kept is None else max_kept
    return _launch(q, k_buffer, v_buffer, None, None, None, kv_indptr, kv_indices, 0, 1,
                   bound, sm_scale, logit_cap, num_kv_splits, impl, block_n, out)


def decode_full(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                **kwargs: Any) -> torch.Tensor:
    """Full decode attention with the same kernel (``sink=0``, ``recent=max_context``): the
    baseline the sink + recent kernel is timed against."""
    return decode_sink_recent(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens,
                              *full_window(req_to_token), **kwargs)
