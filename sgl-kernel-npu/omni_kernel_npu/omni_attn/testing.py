"""Random paged-KV inputs in SGLang's layout, shared by the tests and the GPU check.

Pages are handed out in a shuffled order and requests sit on shuffled rows of a larger
``req_to_token`` pool, so a kernel that assumes contiguous slots, identity row mapping or
page-aligned windows reads the wrong tokens and fails the comparison. Slot 0 stays unused, as
in SGLang, and unused table entries point at it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedInputs:
    """One decode step's attention inputs for a single layer."""

    q: torch.Tensor
    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    req_to_token: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor

    def args(self) -> tuple[torch.Tensor, ...]:
        """Positional arguments of the kernel and reference entry points."""
        return (self.q, self.k_buffer, self.v_buffer, self.req_to_token,
                self.req_pool_indices, self.seq_lens)


def make_paged_inputs(
    seq_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    page_size: int = 4,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    max_context: int | None = None,
    spare_rows: int = 2,
    head_dim_v: int | None = None,
) -> PagedInputs:
    """Random q/K/V with each request's tokens on randomly placed pages."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(seq_lens)
    max_context = max_context or max(max(seq_lens, default=1), 1)
    if max(seq_lens, default=0) > max_context:
        raise ValueError("a sequence is longer than max_context")
    pages_per_req = [-(-n // page_size) for n in seq_lens]
    num_pages = sum(pages_per_req) + 2  # page 0 holds the reserved slot 0, plus one spare
    order = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    num_rows = batch + spare_rows
    rows = torch.randperm(num_rows, generator=gen)[:batch]
    req_to_token = torch.zeros(num_rows, max_context, dtype=torch.int32)
    for b, n in enumerate(seq_lens):
        pages = torch.tensor([order.pop() for _ in range(pages_per_req[b])], dtype=torch.int64)
        pos = torch.arange(n)
        slots = pages[pos // page_size] * page_size + pos % page_size
        req_to_token[rows[b], :n] = slots.to(torch.int32)
    num_slots = num_pages * page_size
    dv = head_dim_v or head_dim
    # Values are drawn on the target device: the GPU check builds gigabytes of KV.
    dev_gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=dev_gen, device=device).to(dtype)

    return PagedInputs(
        q=rand(batch, num_q_heads, head_dim),
        k_buffer=rand(num_slots, num_kv_heads, head_dim),
        v_buffer=rand(num_slots, num_kv_heads, dv),
        req_to_token=req_to_token.to(device),
        req_pool_indices=rows.to(torch.int64).to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64).to(device),
    )


@dataclass
class ExtendInputs(PagedInputs):
    """One extend (prefill) step's attention inputs for a single layer: ``q`` holds only the
    new tokens, packed by ``qo_indptr``; every token's K/V is already in the pool."""

    qo_indptr: torch.Tensor

    def args(self) -> tuple[torch.Tensor, ...]:
        """Positional arguments of the extend kernel and reference entry points."""
        return (*super().args(), self.qo_indptr)


def make_extend_inputs(
    seq_lens: list[int],
    extend_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    extra_rows: int = 0,
    **kwargs: object,
) -> ExtendInputs:
    """Random paged K/V as :func:`make_paged_inputs` (same keyword options) plus packed queries
    for the last ``extend_lens[b]`` positions of each request; ``extra_rows`` trailing q rows
    belong to no request (a padded token buffer)."""
    if len(extend_lens) != len(seq_lens) or any(
            e < 0 or e > n for e, n in zip(extend_lens, seq_lens, strict=True)):
        raise ValueError("need 0 <= extend_len <= seq_len for every request")
    base = make_paged_inputs(seq_lens, num_q_heads, num_kv_heads, head_dim, **kwargs)
    device = base.k_buffer.device
    gen = torch.Generator(device=device).manual_seed(int(kwargs.get("seed", 0)) + 1)
    total = sum(extend_lens) + extra_rows
    q = torch.randn(total, num_q_heads, head_dim, generator=gen, device=device)
    indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor(extend_lens, dtype=torch.int32), 0)
    return ExtendInputs(q=q.to(base.k_buffer.dtype), k_buffer=base.k_buffer,
                        v_buffer=base.v_buffer, req_to_token=base.req_to_token,
                        req_pool_indices=base.req_pool_indices, seq_lens=base.seq_lens,
                        qo_indptr=indptr.to(device))


def to_hybrid_pool(k_buffer: torch.Tensor, v_buffer: torch.Tensor, req_to_token: torch.Tensor,
                   seq_lens: torch.Tensor, req_pool_indices: torch.Tensor, sink: int,
                   recent: int, *, page_size: int = 1, seed: int = 0, poison: bool = True,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Move K/V into a separate "SWA" pool as SGLang's hybrid pool holds compressed layers.

    Returns ``(swa_k, swa_v, slot_map)``: ``slot_map[full_slot]`` is the SWA slot holding that
    token (pages move whole, to shuffled SWA pages). Tokens outside each request's sink +
    recent window are "evicted": their map entry is 0 and, with ``poison``, SWA slot 0 holds
    NaN, so a kernel that reads an evicted key produces NaN.
    """
    gen = torch.Generator().manual_seed(seed + 7)
    num_slots = k_buffer.shape[0]
    num_pages = -(-num_slots // page_size)
    swa_pages = torch.randperm(num_pages, generator=gen) + 1  # SWA page 0 stays the pad page
    full = torch.arange(num_slots)
    slot_map = swa_pages[full // page_size] * page_size + full % page_size
    keep = torch.zeros(num_slots, dtype=torch.bool)
    for row, n in zip(req_pool_indices.tolist(), seq_lens.tolist(), strict=True):
        pos = torch.arange(n)
        kept = (pos < sink) | (pos >= n - recent)
        keep[req_to_token[row, :n][kept].long().cpu()] = True
    slot_map = torch.where(keep, slot_map, torch.zeros_like(slot_map))
    swa_size = (num_pages + 1) * page_size
    device = k_buffer.device
    swa_k = torch.zeros(swa_size, *k_buffer.shape[1:], dtype=k_buffer.dtype, device=device)
    swa_v = torch.zeros(swa_size, *v_buffer.shape[1:], dtype=v_buffer.dtype, device=device)
    dst = slot_map[keep].to(device)
    swa_k[dst] = k_buffer[full[keep].to(device)]
    swa_v[dst] = v_buffer[full[keep].to(device)]
    if poison:
        swa_k[0] = float("nan")
        swa_v[0] = float("nan")
    return swa_k, swa_v, slot_map.to(device)
