"""Pure OmniAttn serving arithmetic: kept keys, freed ranges, pool split (no SGLang)."""

from __future__ import annotations

import pytest
import torch

from omniinfer.attn import masks
from omniinfer.attn import runtime_window as rw


@pytest.mark.parametrize(
    ("seq_len", "sink", "recent"), [(1, 4, 8), (5, 4, 8), (12, 4, 8), (13, 4, 8), (200, 16, 64),
                                    (40, 0, 5), (9, 20, 3)],
)
def test_decode_keys_equal_the_evaluator_mask_row(seq_len: int, sink: int, recent: int) -> None:
    t = seq_len - 1
    row = masks.window_mask(torch.tensor([t]), torch.arange(seq_len), sink, recent)[0]
    assert rw.kept_positions(seq_len, sink, recent) == torch.nonzero(row)[:, 0].tolist()


@pytest.mark.parametrize(("prefix", "seq_len"), [(0, 50), (10, 50), (30, 31), (45, 50)])
def test_extend_span_covers_every_key_its_queries_read(prefix: int, seq_len: int) -> None:
    sink, recent = 4, 8
    span = rw.key_span(prefix, seq_len, sink, recent)
    mask = masks.window_mask(torch.arange(prefix, seq_len), torch.arange(seq_len), sink, recent)
    read = set(torch.nonzero(mask.any(dim=0))[:, 0].tolist())
    assert set(span.positions()) == read
    assert span.size == len(read)


def test_sglang_window_is_recent_minus_one() -> None:
    assert rw.sglang_window(64) == 63
    with pytest.raises(ValueError):
        rw.sglang_window(1)


def test_freeing_keeps_the_sink_and_only_what_later_queries_read() -> None:
    live, freed = rw.simulate_decode(prompt_len=300, new_tokens=50, sink=16, recent=64)
    # The last query (position 349) read the sink and (349 - 64, 349]; nothing else is live.
    assert live[:16] == list(range(16))
    assert live[16:] == list(range(349 - 63, 350))
    assert freed == 349 - 63 - 16


def test_freeing_in_intervals_never_drops_a_needed_key() -> None:
    live, freed = rw.simulate_decode(prompt_len=100, new_tokens=300, sink=8, recent=32,
                                     interval=37)
    assert live[:8] == list(range(8))
    assert len(live) - 8 <= 31 + 37  # at most one interval behind
    assert freed == len(range(400)) - len(live)


def test_freeable_range_waits_for_the_interval_and_starts_at_the_sink() -> None:
    assert rw.freeable_range(pre_len=70, sink=16, recent=64, cursor=0, interval=16) == (16, 16)
    assert rw.freeable_range(pre_len=100, sink=16, recent=64, cursor=0, interval=16) == (16, 37)
    assert rw.freeable_range(pre_len=101, sink=16, recent=64, cursor=37) == (37, 38)


def test_model_overrides_declare_the_compressed_layers_as_window_layers() -> None:
    over = rw.model_overrides(6, [1, 4], recent=64)
    assert over == {"is_hybrid_swa": True, "hybrid_layer_pattern": [0, 1, 0, 0, 1, 0],
                    "sliding_window": 63}


def test_equal_bytes_split_spends_the_uncompressed_budget() -> None:
    split = rw.equal_bytes_split(16384, num_layers=30, num_compressed=12, swa_tokens=6000)
    assert split.full_tokens * 18 + split.swa_tokens * 12 <= 16384 * 30
    assert split.full_tokens * 18 + split.swa_tokens * 12 > 16384 * 30 - 18
    ratio = rw.ratio_split(16384, 30, 12, ratio=0.25)
    assert ratio.full_tokens > 16384 and ratio.swa_tokens == int(ratio.full_tokens * 0.25)
    with pytest.raises(ValueError):
        rw.equal_bytes_split(100, 30, 12, swa_tokens=1000)


def test_admission_model_counts_both_pools() -> None:
    base = rw.PoolSplit(16384, 16384)
    # Without compression every layer holds the whole context.
    assert rw.admissible(base, 2048, sink=2048, recent=2048, interval=0, prefill_chunk=0) == 8
    split = rw.ratio_split(16384, 30, 15, ratio=0.4)
    assert rw.admissible(split, 2048, 128, 384, 128, prefill_chunk=2048) > 8


def test_default_ratio_balances_pools_for_2k_requests() -> None:
    ratio = rw.default_swa_ratio(sink=128, recent=384)
    split = rw.ratio_split(8192, 30, 15, ratio)
    full_need, swa_need = rw.request_kv_tokens(2048, 128, 384, rw.EVICTION_INTERVAL)
    # The compressed pool holds what the full pool's requests keep, plus prefill headroom.
    assert split.swa_tokens >= split.full_tokens // full_need * swa_need
    assert rw.default_swa_ratio(sink=4096, recent=4096) == 1.0


@pytest.mark.parametrize("compressed", [6, 12, 16, 24])
@pytest.mark.parametrize("budget", [4096, 16384, 100_000])
def test_balanced_ratio_admits_as_many_as_the_best_ratio(compressed: int, budget: int) -> None:
    def fits(ratio: float) -> int:
        split = rw.ratio_split(budget, 30, compressed, ratio)
        return rw.admissible(split, 2048, 128, 384, rw.EVICTION_INTERVAL, prefill_chunk=512)

    ratio = rw.balanced_swa_ratio(budget, 30, compressed, 128, 384, prefill_chunk=512)
    best = max(fits(r / 1000) for r in range(10, 1001))
    assert fits(ratio) == best
    assert fits(ratio) >= fits(rw.default_swa_ratio(128, 384))
    # the full pool holds whole requests with no spare request's worth left over
    split = rw.ratio_split(budget, 30, compressed, ratio)
    assert split.full_tokens // 2048 == best


def test_shared_prefix_ratio_fills_both_pools_together() -> None:
    from omniinfer.attn.runtime_window import shared_prefix_swa_ratio

    # 4 prefixes of 1,500 tokens, 24 requests of 126 own tokens, sink 128 + recent 384.
    ratio = shared_prefix_swa_ratio(4, 1500, 24, 126, 128, 384)
    assert ratio == round((4 * 511 + 24 * 126) / (4 * 1500 + 24 * 126), 4)
    # Long outputs: each request's compressed share stops at sink + recent + interval.
    long = shared_prefix_swa_ratio(4, 1500, 24, 2000, 128, 384)
    assert long == round((4 * 511 + 24 * 528) / (4 * 1500 + 24 * 2000), 4)
    assert shared_prefix_swa_ratio(1, 10, 1, 10, 128, 384) == 1.0
    with pytest.raises(ValueError):
        shared_prefix_swa_ratio(0, 1500, 24, 126, 128, 384)


def test_transfer_sink_span_adds_the_sink_below_the_window_only() -> None:
    from omniinfer.attn.runtime_window import transfer_sink_span

    # a 2K prompt, window 383 (recent 384), sink 128: the sink is below the window
    assert transfer_sink_span(0, 2048, 383, 128, 1) == (0, 128)
    # short prompt: the window starts at 17, only what lies below it is added
    assert transfer_sink_span(0, 400, 383, 128, 1) == (0, 17)
    # the window covers everything: nothing to add
    assert transfer_sink_span(0, 300, 383, 128, 1) == (0, 0)
    # the decode side already holds a prefix past the sink: nothing to add
    assert transfer_sink_span(256, 2048, 383, 128, 1) == (256, 256)
    # paged: the sink rounds up to whole pages, the window start down
    assert transfer_sink_span(0, 2048, 383, 100, 64) == (0, 128)
    assert transfer_sink_span(0, 500, 383, 100, 64) == (0, 64)  # window starts at page 64
    for prefix, seq, window, sink, page in [(0, 5000, 255, 64, 16), (32, 900, 127, 48, 16)]:
        lo, hi = transfer_sink_span(prefix, seq, window, sink, page)
        window_start = max(prefix, seq - window) // page * page
        assert lo == prefix and hi <= window_start and hi % page == 0 or hi == lo
