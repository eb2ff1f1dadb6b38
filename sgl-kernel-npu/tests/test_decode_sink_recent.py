"""The Triton sink + recent decode kernel against the PyTorch reference.

Under the interpreter every program runs in Python, so shapes stay tiny (a few requests, 2-8 q
heads, head_dim 16-32) while still covering GQA, random page placement, windows that cross page
boundaries, sequences shorter than the sink, empty splits and padded (length 0) rows.
"""

from __future__ import annotations

import pytest
import torch

from omni_kernel_npu.omni_attn import decode_sink_recent as kernels
from omni_kernel_npu.omni_attn.indices import build_kv_indices
from omni_kernel_npu.omni_attn.reference import (
    decode_full_reference,
    decode_sink_recent_reference,
)
from omni_kernel_npu.omni_attn.testing import PagedInputs, make_paged_inputs

SINK, RECENT = 4, 8
TOL = {
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.float16: {"atol": 4e-3, "rtol": 1e-2},
    torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
}
# Lengths around every boundary: below the sink, at sink + recent, one past it, long.
LONG_MIX = [1, 3, 12, 13, 29, 37]


def _inputs(lens: list[int], q_heads: int, kv_heads: int, dtype: torch.dtype, device: str,
            head_dim: int = 16, seed: int = 0) -> PagedInputs:
    return make_paged_inputs(lens, q_heads, kv_heads, head_dim, page_size=4, dtype=dtype,
                             device=device, seed=seed, max_context=max(lens) + 3)


def _assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.to(out.device), **TOL[dtype])


@pytest.mark.parametrize(
    ("impl", "dtype", "q_heads", "kv_heads", "batch"),
    [
        ("head", torch.float32, 2, 2, 1),  # MHA, one request
        ("head", torch.float32, 4, 2, 3),  # GQA 2
        ("head", torch.bfloat16, 4, 1, 4),  # GQA 4
        ("grouped", torch.float16, 8, 2, 6),  # GQA 4, tl.dot path
        ("grouped", torch.bfloat16, 4, 1, 3),  # MQA-like group 4
    ],
)
def test_long_sequences_match_reference_not_full(
    impl: str, dtype: torch.dtype, q_heads: int, kv_heads: int, batch: int, device: str
) -> None:
    lens = LONG_MIX[-batch:]
    inp = _inputs(lens, q_heads, kv_heads, dtype, device, seed=batch)
    out = kernels.decode_sink_recent(*inp.args(), SINK, RECENT, impl=impl, block_n=16)
    ref = decode_sink_recent_reference(*inp.args(), SINK, RECENT)
    _assert_close(out, ref, dtype)
    full = decode_full_reference(*inp.args()).to(out.device)
    evicting = inp.seq_lens > SINK + RECENT
    assert evicting.any()
    gap = (out.float() - full)[evicting].abs().amax()
    assert gap > 20 * TOL[dtype]["atol"], "evicted tokens must change the result"


@pytest.mark.parametrize(("impl", "dtype"), [("head", torch.float32), ("grouped", torch.float16)])
def test_short_sequences_equal_full_attention(impl: str, dtype: torch.dtype, device: str) -> None:
    inp = _inputs([1, 2, 5, 11, 12], 2, 1, dtype, device, seed=7)
    out = kernels.decode_sink_recent(*inp.args(), SINK, RECENT, impl=impl, block_n=16)
    _assert_close(out, decode_full_reference(*inp.args()), dtype)


def test_same_kernel_as_full_attention(device: str) -> None:
    inp = _inputs([3, 20, 33], 4, 2, torch.float32, device, seed=3)
    out = kernels.decode_full(*inp.args(), block_n=16, num_kv_splits=3)
    _assert_close(out, decode_full_reference(*inp.args()), torch.float32)


@pytest.mark.parametrize(("impl", "dtype"), [("head", torch.float32), ("grouped", torch.bfloat16)])
def test_index_list_variant_equals_in_kernel_window(
    impl: str, dtype: torch.dtype, device: str
) -> None:
    inp = _inputs([2, 13, 30], 4, 2, dtype, device, seed=11)
    indptr, indices = build_kv_indices(inp.req_to_token, inp.req_pool_indices, inp.seq_lens,
                                       SINK, RECENT)
    out = kernels.decode_paged_indices(inp.q, inp.k_buffer, inp.v_buffer, indptr, indices,
                                       max_kept=SINK + RECENT, impl=impl, block_n=16)
    _assert_close(out, decode_sink_recent_reference(*inp.args(), SINK, RECENT), dtype)


def test_split_count_does_not_change_the_result(device: str) -> None:
    """One split, and more splits than 16-token blocks (most of them empty)."""
    inp = _inputs([13, 29, 40], 2, 1, torch.float32, device, seed=5)
    one = kernels.decode_sink_recent(*inp.args(), 6, 20, num_kv_splits=1, block_n=16)
    many = kernels.decode_sink_recent(*inp.args(), 6, 20, num_kv_splits=4, block_n=16)
    ref = decode_sink_recent_reference(*inp.args(), 6, 20)
    _assert_close(one, ref, torch.float32)
    _assert_close(many, ref, torch.float32)


def test_logit_cap_scale_and_odd_head_dim(device: str) -> None:
    """SGLang's tanh logit cap and sm_scale, with head_dim 24 padded to a 32-wide block."""
    inp = _inputs([9, 31], 4, 2, torch.float16, device, head_dim=24, seed=9)
    inp.q.mul_(4)  # large logits, so the cap matters
    out = kernels.decode_sink_recent(*inp.args(), SINK, RECENT, sm_scale=0.3, logit_cap=2.0,
                                     impl="grouped", block_n=16)
    ref = decode_sink_recent_reference(*inp.args(), SINK, RECENT, sm_scale=0.3, logit_cap=2.0)
    _assert_close(out, ref, torch.float16)
    uncapped = decode_sink_recent_reference(*inp.args(), SINK, RECENT, sm_scale=0.3)
    assert (ref - uncapped).abs().max() > 1e-2


def test_padded_rows_give_zeros(device: str) -> None:
    """Length-0 rows (a padded batch) write zeros instead of NaN, next to a real request."""
    inp = _inputs([0, 17], 2, 1, torch.float32, device, seed=2)
    out = kernels.decode_sink_recent(*inp.args(), SINK, RECENT, block_n=16)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    _assert_close(out, decode_sink_recent_reference(*inp.args(), SINK, RECENT), torch.float32)


def test_rejects_bad_arguments(device: str) -> None:
    inp = _inputs([5], 4, 2, torch.float32, device)
    with pytest.raises(ValueError):
        kernels.decode_sink_recent(*inp.args(), SINK, 0)
    with pytest.raises(ValueError):
        kernels.decode_sink_recent(*inp.args(), SINK, RECENT, impl="grouped")  # fp32
    with pytest.raises(ValueError):
        kernels.decode_sink_recent(*inp.args(), SINK, RECENT, block_n=8)
    bad_q = torch.zeros(1, 3, 16, device=device)  # 3 q heads over 2 kv heads
    with pytest.raises(ValueError):
        kernels.decode_sink_recent(bad_q, *inp.args()[1:], SINK, RECENT)
