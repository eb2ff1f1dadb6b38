"""The omni_triton backend's compressed-layer path on SGLang's real pool objects, interpreted.

Run by ``test_attn_runtime_triton.py`` in a subprocess with ``TRITON_INTERPRET=1`` (Triton picks
the interpreter when a kernel is defined). Real ``SWAKVPool`` / ``SWATokenToKVPoolAllocator`` /
``ReqToTokenPool`` objects, tiny and on CPU, at page sizes 1, 16 and 64: tokens are allocated
by SGLang's allocators (the SWA side offset so that full and SWA slots differ), K/V written by
the pool's own write path, out-of-window slots freed with ``free_swa`` as SGLang's window
eviction does (sink kept), and the pad slot poisoned with NaN. The kernels' output must equal
the torch_native path's masked evaluator (:class:`CompressedAttention`) on the same pool.
"""

from __future__ import annotations

from omniinfer.cpu import import_shims

import_shims.install()  # noqa: E402 -- SGLang's imports need the CPU stand-ins first

from types import SimpleNamespace  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.memory_pool import KVWriteLoc, ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402

from omniinfer.sglang_plugin.omni_attn import triton_backend  # noqa: E402
from omniinfer.sglang_plugin.omni_attn.backend import CompressedAttention  # noqa: E402

SINK, RECENT = 8, 24
KV_HEADS, Q_HEADS, DIM = 2, 4, 16
COMPRESSED, FULL = 0, 1
ROWS = [3, 1, 2]  # requests sit on shuffled req_to_token rows


def _layer(layer_id: int = COMPRESSED) -> Any:
    return SimpleNamespace(layer_id=layer_id, tp_q_head_num=Q_HEADS, tp_k_head_num=KV_HEADS,
                           qk_head_dim=DIM, v_head_dim=DIM, scaling=DIM ** -0.5, logit_cap=0.0,
                           is_cross_attention=False, k_scale=None, v_scale=None)


class Pools:
    """One hybrid pool with requests of the given lengths allocated and written."""

    def __init__(self, page: int, lens: list[int], seed: int = 0) -> None:
        self.page = page
        size = 2048
        self.kv = SWAKVPool(size=size, size_swa=size, page_size=page, dtype=torch.float32,
                            head_num=KV_HEADS, head_dim=DIM, v_head_dim=DIM,
                            swa_attention_layer_ids=[COMPRESSED],
                            full_attention_layer_ids=[FULL], device="cpu",
                            enable_memory_saver=False)
        self.req = ReqToTokenPool(size=4, max_context_len=256, device="cpu",
                                  enable_memory_saver=False)
        self.alloc = SWATokenToKVPoolAllocator(size, size, page, torch.float32, "cpu", self.kv,
                                               need_sort=False)
        self.alloc.swa_attn_allocator.alloc(3 * page)  # full and SWA slots now differ
        self.rows = torch.tensor(ROWS[: len(lens)], dtype=torch.int64)
        self.lens = torch.tensor(lens, dtype=torch.int64)
        if page == 1:
            loc = torch.cat([self.alloc.alloc(n) for n in lens])
        else:
            zero = torch.zeros(len(lens), dtype=torch.int64)
            loc = self.alloc.alloc_extend(zero, zero, self.lens, self.lens,
                                          torch.full((len(lens),), -1), sum(lens))
        start = 0
        for row, n in zip(ROWS, lens, strict=False):
            self.req.req_to_token[row, :n] = loc[start:start + n].to(torch.int32)
            start += n
        gen = torch.Generator().manual_seed(seed)
        k = torch.randn(len(loc), KV_HEADS, DIM, generator=gen)
        v = torch.randn(len(loc), KV_HEADS, DIM, generator=gen)
        swa = self.alloc.translate_loc_from_full_to_swa(loc)
        assert not torch.equal(swa, loc)
        self.kv.set_kv_buffer(_layer(), KVWriteLoc(loc, swa), k, v)

    def evict_before(self, first_query: list[int]) -> int:
        """Free what SGLang's window eviction frees: whole pages in [sink, window start) of
        the earliest query; poison the pad slot. Returns the slots freed."""
        freed = 0
        for row, q0 in zip(self.rows.tolist(), first_query, strict=True):
            lo = -(-SINK // self.page) * self.page
            hi = (q0 - RECENT + 1) // self.page * self.page
            if hi > lo:
                self.alloc.free_swa(self.req.req_to_token[row, lo:hi].to(torch.int64))
                freed += hi - lo
        for buf in (self.kv.get_key_buffer(COMPRESSED), self.kv.get_value_buffer(COMPRESSED)):
            buf[0] = float("nan")
        return freed

    def evaluator(self, q: torch.Tensor, batch: Any, decode: bool) -> torch.Tensor:
        """The torch_native path's masked evaluator on the same pool."""
        attention = CompressedAttention([COMPRESSED], SINK, RECENT)
        backend = SimpleNamespace(token_to_kv_pool=self.kv, req_to_token_pool=self.req)
        return attention.forward(backend, q, None, None, _layer(), batch, False, decode)


@pytest.fixture(scope="module")
def attn() -> triton_backend.SinkRecentLayers:
    return triton_backend.SinkRecentLayers([COMPRESSED], SINK, RECENT)


@pytest.mark.parametrize("page", [1, 16, 64])
def test_decode_on_real_pools_equals_the_masked_evaluator(
        page: int, attn: triton_backend.SinkRecentLayers) -> None:
    lens = [20, 90, 170]  # under the window, past it, far past it
    pools = Pools(page, lens, seed=page)
    assert pools.evict_before([n - 1 for n in lens]) > 0
    q = torch.randn(len(lens), Q_HEADS * DIM, generator=torch.Generator().manual_seed(1))
    batch = SimpleNamespace(seq_lens=pools.lens, req_pool_indices=pools.rows)
    out = attn.attend(pools.kv, pools.req.req_to_token, q, _layer(), pools.rows, pools.lens)
    want = pools.evaluator(q, batch, decode=True)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("page", [1, 16, 64])
def test_extend_on_real_pools_equals_the_masked_evaluator(
        page: int, attn: triton_backend.SinkRecentLayers) -> None:
    lens, new = [60, 150, 40], [60, 37, 1]  # fresh prompt, chunk after a prefix, one token
    pools = Pools(page, lens, seed=page + 1)
    pools.evict_before([n - e for n, e in zip(lens, new, strict=True)])
    q = torch.randn(sum(new), Q_HEADS * DIM, generator=torch.Generator().manual_seed(2))
    new_t = torch.tensor(new)
    indptr = torch.zeros(len(new) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(new_t, 0)
    batch = SimpleNamespace(seq_lens=pools.lens, req_pool_indices=pools.rows,
                            extend_prefix_lens=pools.lens - new_t, extend_seq_lens=new_t)
    out = attn.attend(pools.kv, pools.req.req_to_token, q, _layer(), pools.rows, pools.lens,
                      indptr, max(new))
    want = pools.evaluator(q, batch, decode=False)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)


def test_backend_writes_then_reads_compressed_layers_and_leaves_full_ones(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The registered backend class: a decode step writes the new token's K/V through SGLang's
    write path into the SWA sub-pool and reads sink + recent; a full layer goes to the parent."""
    pools = Pools(16, [70, 120], seed=5)
    triton_backend.set_pattern([COMPRESSED], SINK, RECENT)
    cls = triton_backend.backend_class()
    backend = object.__new__(cls)  # no model runner: only what the forward path reads
    last = pools.lens - 1  # the last allocated position is this step's token
    out_loc = pools.req.req_to_token[pools.rows, last].to(torch.int64)
    backend.token_to_kv_pool, backend.req_to_token = pools.kv, pools.req.req_to_token
    backend.dcp_size = 1
    backend.forward_metadata = SimpleNamespace(
        swa_out_cache_loc=pools.alloc.translate_loc_from_full_to_swa(out_loc))
    pools.evict_before(last.tolist())
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, h * DIM, generator=gen) for h in (Q_HEADS, KV_HEADS, KV_HEADS))
    batch = SimpleNamespace(forward_mode=ForwardMode.DECODE, out_cache_loc=out_loc,
                            out_cache_loc_is_physical=False, seq_lens=pools.lens,
                            req_pool_indices=pools.rows, spec_info=None)
    out = backend.forward_decode(q, k.view(2, KV_HEADS, DIM), v.view(2, KV_HEADS, DIM),
                                 _layer(), batch)
    swa_slots = backend.forward_metadata.swa_out_cache_loc
    torch.testing.assert_close(pools.kv.get_key_buffer(COMPRESSED)[swa_slots],
                               k.view(2, KV_HEADS, DIM))
    torch.testing.assert_close(out, pools.evaluator(q, batch, decode=True), atol=2e-5, rtol=2e-5)

    def parent(self: Any, *args: Any, **kwargs: Any) -> str:
        return "triton"

    monkeypatch.setattr(cls.__mro__[1], "forward_decode", parent)
    assert backend.forward_decode(q, k, v, _layer(FULL), batch) == "triton"
    with pytest.raises(NotImplementedError):
        backend.forward_decode(q, k, v, _layer(), batch, sinks=torch.zeros(Q_HEADS))


def test_registration_adds_the_choice_and_the_factory() -> None:
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    triton_backend.register_backend(with_factory=True)
    triton_backend.register_backend(with_factory=True)  # idempotent
    assert ATTENTION_BACKEND_CHOICES.count(triton_backend.BACKEND_NAME) == 1
    assert ATTENTION_BACKENDS[triton_backend.BACKEND_NAME] is triton_backend.create_backend
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    assert issubclass(triton_backend.backend_class(), TritonAttnBackend)
