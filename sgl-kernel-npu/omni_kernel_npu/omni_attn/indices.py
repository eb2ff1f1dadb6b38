"""Which token positions a compressed (sink + recent) layer keeps, as plain torch.

The kernel computes the same mapping in-kernel; these helpers exist for the reference, for the
explicit ``kv_indptr``/``kv_indices`` variant and for tests, so every consumer agrees on one
definition: for a sequence of length ``L`` the kept positions are
``[0, min(sink, L)) ∪ [max(sink, L - recent), L)`` (the current token is the last one kept).
"""

from __future__ import annotations

import torch


def kept_count(seq_len: int, sink: int, recent: int) -> int:
    """Number of kept positions; all of them once ``seq_len <= sink + recent``."""
    return min(seq_len, sink + recent)


def kept_positions(seq_len: int, sink: int, recent: int, device: torch.device | str = "cpu"
                   ) -> torch.Tensor:
    """Kept positions of one sequence, ascending, as int64."""
    check_window(sink, recent)
    head = torch.arange(min(sink, seq_len), device=device)
    tail = torch.arange(min(max(sink, seq_len - recent), seq_len), seq_len, device=device)
    return torch.cat([head, tail])


def full_window(req_to_token: torch.Tensor) -> tuple[int, int]:
    """``(sink, recent)`` that keep every position of a ``req_to_token`` table: ordinary full
    attention with the same kernels and references (the baselines they are timed against)."""
    return 0, max(1, req_to_token.shape[1])


def check_window(sink: int, recent: int) -> None:
    """Reject windows the kernel does not define: the current token must be kept."""
    if sink < 0 or recent < 1:
        raise ValueError(f"need sink >= 0 and recent >= 1, got sink={sink} recent={recent}")


def build_kv_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sink: int,
    recent: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang-style ``(kv_indptr, kv_indices)`` over the kept slots of each request.

    This is the materialized form a backend that already builds window index lists (the SWA
    path) would hand to :func:`decode_paged_indices`; it syncs with the host once to size the
    list, which the in-kernel sink/recent variant avoids.
    """
    check_window(sink, recent)
    device = req_to_token.device
    lens = seq_lens.to(device=device, dtype=torch.int64)
    n_sink = torch.clamp(lens, max=sink)
    n_kept = torch.clamp(lens, max=sink + recent)
    recent_start = lens - (n_kept - n_sink)
    kv_indptr = torch.zeros(lens.numel() + 1, dtype=torch.int32, device=device)
    kv_indptr[1:] = torch.cumsum(n_kept, 0)
    total = int(kv_indptr[-1].item())
    owner = torch.repeat_interleave(torch.arange(lens.numel(), device=device), n_kept,
                                    output_size=total)
    j = torch.arange(total, device=device) - kv_indptr[:-1].to(torch.int64)[owner]
    pos = torch.where(j < n_sink[owner], j, recent_start[owner] + j - n_sink[owner])
    rows = req_pool_indices.to(device=device, dtype=torch.int64)[owner]
    kv_indices = req_to_token[rows, pos].to(torch.int64)
    return kv_indptr, kv_indices


def sink_recent_mask(prefix_len: int, seq_len: int, sink: int, recent: int,
                     device: torch.device | str = "cpu") -> torch.Tensor:
    """``[seq_len - prefix_len, seq_len]`` bool: may the query at position ``i`` (rows, from
    ``prefix_len``) read the key at ``j``? Causal, and ``j < sink`` or ``j > i - recent``; for
    the last query this is exactly :func:`kept_positions`."""
    check_window(sink, recent)
    i = torch.arange(prefix_len, seq_len, device=device)[:, None]
    j = torch.arange(seq_len, device=device)[None, :]
    return (j <= i) & ((j < sink) | (j > i - recent))
