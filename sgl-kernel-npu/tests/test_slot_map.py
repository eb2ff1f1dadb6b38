"""Kernels reading a compressed layer from the SWA sub-pool of SGLang's hybrid KV pool.

``req_to_token`` holds full-pool slots; the compressed layer's K/V live at other (SWA) slots,
reached through ``slot_map`` (SGLang's ``full_to_swa_index_mapping``). Evicted tokens map to
the pad slot, which holds NaN here: reading one would poison the output.
"""

from __future__ import annotations

import pytest
import torch

from omni_kernel_npu.omni_attn.decode_sink_recent import decode_sink_recent
from omni_kernel_npu.omni_attn.extend_sink_recent import extend_sink_recent
from omni_kernel_npu.omni_attn.reference import (
    decode_sink_recent_reference,
    extend_sink_recent_reference,
)
from omni_kernel_npu.omni_attn.testing import (
    make_extend_inputs,
    make_paged_inputs,
    to_hybrid_pool,
)

SINK, RECENT = 16, 48
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_through_slot_map_equals_reference(page_size: int, dtype: torch.dtype,
                                                  device: str) -> None:
    lens = [30, 70, 150]  # shorter than the window, just over it, well past it
    inp = make_paged_inputs(lens, 4, 2, 16, page_size=page_size, dtype=dtype, device=device,
                            seed=page_size, max_context=160)
    swa_k, swa_v, slot_map = to_hybrid_pool(
        inp.k_buffer, inp.v_buffer, inp.req_to_token, inp.seq_lens, inp.req_pool_indices,
        SINK, RECENT, page_size=page_size, seed=page_size)
    out = decode_sink_recent(inp.q, swa_k, swa_v, inp.req_to_token, inp.req_pool_indices,
                             inp.seq_lens, SINK, RECENT, slot_map=slot_map)
    ref = decode_sink_recent_reference(*inp.args(), SINK, RECENT)
    assert torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_extend_through_slot_map_equals_reference(page_size: int, device: str) -> None:
    lens, new = [40, 130], [40, 33]  # a fresh prompt and a chunk after a cached prefix
    inp = make_extend_inputs(lens, new, 4, 2, 16, page_size=page_size, device=device,
                             seed=page_size, max_context=140)
    # Extend reads every window a new query needs: keep [0, sink) and the last
    # recent + new - 1 positions (what SGLang still holds while the chunk is prefilled).
    swa_k, swa_v, slot_map = to_hybrid_pool(
        inp.k_buffer, inp.v_buffer, inp.req_to_token, inp.seq_lens, inp.req_pool_indices,
        SINK, RECENT + max(new), page_size=page_size, seed=page_size)
    out = extend_sink_recent(inp.q, swa_k, swa_v, inp.req_to_token, inp.req_pool_indices,
                             inp.seq_lens, inp.qo_indptr, SINK, RECENT, block_m=16,
                             block_n=16, slot_map=slot_map)
    ref = extend_sink_recent_reference(*inp.args(), SINK, RECENT)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_slot_map_is_what_makes_the_pool_readable(device: str) -> None:
    inp = make_paged_inputs([100], 2, 2, 16, page_size=16, device=device, max_context=100)
    swa_k, swa_v, slot_map = to_hybrid_pool(
        inp.k_buffer, inp.v_buffer, inp.req_to_token, inp.seq_lens, inp.req_pool_indices,
        SINK, RECENT, page_size=16)
    wrong = decode_sink_recent(inp.q, swa_k, swa_v, inp.req_to_token, inp.req_pool_indices,
                               inp.seq_lens, SINK, RECENT)  # full slots used as SWA slots
    ref = decode_sink_recent_reference(*inp.args(), SINK, RECENT)
    assert not torch.allclose(wrong.nan_to_num(0.0), ref, atol=1e-3)
    with pytest.raises(ValueError, match="slot_map"):
        decode_sink_recent(inp.q, swa_k, swa_v, inp.req_to_token, inp.req_pool_indices,
                           inp.seq_lens, SINK, RECENT, slot_map=slot_map.float())
