"""The Triton sink + recent extend (prefill) kernel against the dense-mask PyTorch reference.

Tiny shapes for the interpreter (head_dim 16, 16-wide blocks) that still cover GQA, prefixes of
0 and more, several query blocks per request, windows crossing pages of size 1/16/64 placed in
shuffled order, padded and empty requests, and the block skipping itself (keys no query may read
are poisoned with NaN and must not reach the output).
"""

from __future__ import annotations

import pytest
import torch

from omni_kernel_npu.omni_attn import extend_sink_recent as ext
from omni_kernel_npu.omni_attn.indices import kept_positions, sink_recent_mask
from omni_kernel_npu.omni_attn.reference import (
    decode_sink_recent_reference,
    extend_sink_recent_reference,
)
from omni_kernel_npu.omni_attn.testing import ExtendInputs, make_extend_inputs

SINK, RECENT = 4, 12
BLOCKS = {"block_m": 16, "block_n": 16}
TOL = {
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.float16: {"atol": 4e-3, "rtol": 1e-2},
    torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
}


def _inputs(lens: list[int], new: list[int], q_heads: int, kv_heads: int, dtype: torch.dtype,
            device: str, page_size: int = 4, seed: int = 0, extra_rows: int = 0
            ) -> ExtendInputs:
    return make_extend_inputs(lens, new, q_heads, kv_heads, 16, page_size=page_size,
                              dtype=dtype, device=device, seed=seed,
                              max_context=max(lens) + 5, extra_rows=extra_rows)


def _full_reference(inp: ExtendInputs) -> torch.Tensor:
    return extend_sink_recent_reference(*inp.args(), 0, inp.req_to_token.shape[1])


def _rows(inp: ExtendInputs) -> int:
    return int(inp.qo_indptr[-1])


def _assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, rows: int) -> None:
    assert out.dtype == dtype
    torch.testing.assert_close(out[:rows].float(), ref[:rows].to(out.device), **TOL[dtype])


def test_mask_matches_decode_kept_set() -> None:
    """The last query's row of the extend mask is the decode kernel's kept set."""
    for length in (1, 5, 16, 17, 40):
        mask = sink_recent_mask(length - 3 if length > 3 else 0, length, SINK, RECENT)
        assert torch.equal(mask[-1].nonzero().flatten(), kept_positions(length, SINK, RECENT))


@pytest.mark.parametrize(
    ("dtype", "q_heads", "kv_heads"),
    [
        (torch.float32, 2, 2),  # MHA
        (torch.float32, 4, 2),  # GQA 2
        (torch.float16, 8, 2),  # GQA 4, tl.dot path
        (torch.bfloat16, 4, 1),  # group 4 on one kv head
    ],
)
def test_long_requests_match_reference_not_full(
    dtype: torch.dtype, q_heads: int, kv_heads: int, device: str
) -> None:
    # whole prompt (prefix 0, 3 query blocks), prefix 30 + 20 new, prefix 60 + 1 new
    inp = _inputs([40, 50, 61], [40, 20, 1], q_heads, kv_heads, dtype, device, seed=q_heads)
    out = ext.extend_sink_recent(*inp.args(), SINK, RECENT, **BLOCKS)
    ref = extend_sink_recent_reference(*inp.args(), SINK, RECENT)
    rows = _rows(inp)
    _assert_close(out, ref, dtype, rows)
    gap = (out[:rows].float() - _full_reference(inp)[:rows].to(out.device)).abs().amax()
    assert gap > 20 * TOL[dtype]["atol"], "evicted keys must change the result"


def test_last_query_equals_decode_reference(device: str) -> None:
    """Extending by one token is a decode step: same answer as the decode reference."""
    inp = _inputs([37, 9], [1, 1], 4, 2, torch.float32, device, seed=4)
    out = ext.extend_sink_recent(*inp.args(), SINK, RECENT, **BLOCKS)
    dec = decode_sink_recent_reference(inp.q, *inp.args()[1:6], SINK, RECENT)
    _assert_close(out, dec, torch.float32, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_short_requests_equal_causal_attention(dtype: torch.dtype, device: str) -> None:
    """Up to sink + recent tokens nothing is evicted: plain causal attention."""
    inp = _inputs([16, 10, 7], [16, 4, 7], 4, 2, dtype, device, seed=7)
    out = ext.extend_sink_recent(*inp.args(), SINK, RECENT, **BLOCKS)
    _assert_close(out, _full_reference(inp), dtype, _rows(inp))


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_page_sizes_with_shuffled_pages(page_size: int, device: str) -> None:
    inp = _inputs([45, 90, 70], [12, 33, 70], 4, 2, torch.float16, device,
                  page_size=page_size, seed=page_size)
    out = ext.extend_sink_recent(*inp.args(), SINK, RECENT, **BLOCKS)
    _assert_close(out, extend_sink_recent_reference(*inp.args(), SINK, RECENT), torch.float16,
                  _rows(inp))


def test_full_window_is_causal_attention(device: str) -> None:
    inp = _inputs([33, 18], [20, 18], 4, 2, torch.float32, device, seed=3)
    out = ext.extend_full(*inp.args(), **BLOCKS)
    _assert_close(out, _full_reference(inp), torch.float32, _rows(inp))


def test_empty_and_padded_requests(device: str) -> None:
    """Requests with no new tokens (seq_len 0 or cached only) and q rows owned by no request:
    nothing is written there, the real requests are unaffected."""
    inp = _inputs([0, 30, 25, 19], [0, 0, 25, 5], 4, 2, torch.float32, device, seed=5,
                  extra_rows=3)
    out = torch.full((inp.q.shape[0], 4, 16), 7.0, device=inp.q.device)
    ext.extend_sink_recent(*inp.args(), SINK, RECENT, max_extend_len=48, out=out, **BLOCKS)
    rows = _rows(inp)
    assert rows == 30
    assert torch.all(out[rows:] == 7.0)
    _assert_close(out, extend_sink_recent_reference(*inp.args(), SINK, RECENT), torch.float32,
                  rows)


def test_unread_keys_are_never_loaded(device: str) -> None:
    """Keys at ``[sink, prefix - recent]`` are read by no query; NaN there must not leak, so
    the kernel skips those blocks instead of masking them (0 * NaN would be NaN)."""
    inp = _inputs([90], [20], 2, 1, torch.float16, device, page_size=16, seed=8)
    ref = extend_sink_recent_reference(*inp.args(), SINK, RECENT)
    prefix = 70
    unread = inp.req_to_token[int(inp.req_pool_indices[0]), SINK:prefix - RECENT + 1].long()
    inp.k_buffer[unread] = float("nan")
    inp.v_buffer[unread] = float("nan")
    out = ext.extend_sink_recent(*inp.args(), SINK, RECENT, **BLOCKS)
    assert torch.isfinite(out[:20]).all()
    _assert_close(out, ref, torch.float16, 20)
    full = ext.extend_full(*inp.args(), **BLOCKS)
    assert torch.isnan(full[:20]).any(), "the poison must be visible to full attention"


def test_logit_cap_and_scale(device: str) -> None:
    inp = _inputs([40], [24], 4, 2, torch.float32, device, seed=9)
    inp.q.mul_(4)
    out = ext.extend_sink_recent(*inp.args(), SINK, RECENT, sm_scale=0.3, logit_cap=2.0,
                                 **BLOCKS)
    ref = extend_sink_recent_reference(*inp.args(), SINK, RECENT, sm_scale=0.3, logit_cap=2.0)
    _assert_close(out, ref, torch.float32, 24)
    uncapped = extend_sink_recent_reference(*inp.args(), SINK, RECENT, sm_scale=0.3)
    assert (ref - uncapped).abs().max() > 1e-2


def test_default_blocks_and_grid_from_indptr(device: str) -> None:
    """The 64-wide 16-bit defaults and the host-side max_extend_len give the same answer."""
    inp = _inputs([80, 20], [70, 20], 2, 1, torch.bfloat16, device, seed=10)
    out = ext.extend_sink_recent(*inp.args(), SINK, RECENT)
    _assert_close(out, extend_sink_recent_reference(*inp.args(), SINK, RECENT), torch.bfloat16,
                  _rows(inp))


def test_rejects_bad_arguments(device: str) -> None:
    inp = _inputs([8], [4], 4, 2, torch.float32, device)
    with pytest.raises(ValueError):
        ext.extend_sink_recent(*inp.args(), SINK, 0)
    with pytest.raises(ValueError):
        ext.extend_sink_recent(*inp.args(), SINK, RECENT, block_m=8)
    with pytest.raises(ValueError):
        ext.extend_sink_recent(*inp.args()[:6], inp.qo_indptr[:1], SINK, RECENT)
    bad_q = torch.zeros(4, 3, 16, device=device)
    with pytest.raises(ValueError):
        ext.extend_sink_recent(bad_q, *inp.args()[1:], SINK, RECENT)
