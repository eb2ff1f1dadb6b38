"""The reference and index helpers agree with the OmniAttn definition (torch only, fast)."""

from __future__ import annotations

import pytest
import torch

from omni_kernel_npu.omni_attn.indices import build_kv_indices, kept_count, kept_positions
from omni_kernel_npu.omni_attn.reference import (
    decode_full_reference,
    decode_sink_recent_reference,
)
from omni_kernel_npu.omni_attn.testing import make_paged_inputs


@pytest.mark.parametrize(
    ("length", "sink", "recent", "expected"),
    [
        (0, 4, 8, []),
        (3, 4, 8, [0, 1, 2]),  # shorter than the sink
        (12, 4, 8, list(range(12))),  # exactly sink + recent: everything
        (13, 4, 8, [0, 1, 2, 3, *range(5, 13)]),  # first eviction
        (20, 0, 3, [17, 18, 19]),  # pure window
        (6, 2, 1, [0, 1, 5]),  # only the current token in the window
    ],
)
def test_kept_positions(length: int, sink: int, recent: int, expected: list[int]) -> None:
    pos = kept_positions(length, sink, recent)
    assert pos.tolist() == expected
    assert kept_count(length, sink, recent) == len(expected)


def test_window_must_keep_current_token() -> None:
    with pytest.raises(ValueError):
        kept_positions(5, 2, 0)


def test_build_kv_indices_matches_positions() -> None:
    inp = make_paged_inputs([0, 3, 12, 29], 2, 1, 8, max_context=32)
    indptr, indices = build_kv_indices(inp.req_to_token, inp.req_pool_indices, inp.seq_lens,
                                       4, 8)
    for b, length in enumerate(inp.seq_lens.tolist()):
        row = inp.req_to_token[inp.req_pool_indices[b]]
        expected = row[kept_positions(length, 4, 8)].tolist()
        assert indices[indptr[b]:indptr[b + 1]].tolist() == expected


def test_reference_short_is_full_and_long_is_not() -> None:
    inp = make_paged_inputs([5, 12, 40], 4, 2, 16, max_context=40)
    out = decode_sink_recent_reference(*inp.args(), 4, 8)
    full = decode_full_reference(*inp.args())
    torch.testing.assert_close(out[:2], full[:2])
    assert (out[2] - full[2]).abs().max() > 1e-2
