"""The pure prefix-reuse rules of OmniAttn with a radix cache (no SGLang)."""

from __future__ import annotations

import random

import pytest

from omniinfer.attn import radix_sink as rs


def test_sink_end_rounds_up_to_a_page() -> None:
    assert rs.sink_end(128, 1) == 128
    assert rs.sink_end(100, 16) == 112
    assert rs.sink_end(0, 16) == 0
    with pytest.raises(ValueError):
        rs.sink_end(4, 0)


def test_live_ranges_keep_the_sink_and_the_tail() -> None:
    assert rs.live_ranges(0, 60, evicted=40, sink_stop=8) == [(0, 8), (40, 60)]
    assert rs.live_ranges(0, 60, evicted=0, sink_stop=8) == [(0, 60)]
    assert rs.live_ranges(30, 60, evicted=40, sink_stop=8) == [(40, 60)]  # above the sink
    assert rs.live_ranges(0, 6, evicted=40, sink_stop=8) == [(0, 6)]
    assert rs.live_ranges(0, 60, evicted=8, sink_stop=8) == [(0, 60)]  # touching ranges merge


def test_reusable_needs_sink_and_window() -> None:
    sink, recent = 4, 5
    alive = [True] * 20
    assert rs.reusable(alive, 20, sink, recent)
    alive[2] = False  # a sink position
    assert not rs.reusable(alive, 20, sink, recent)
    assert rs.reusable(alive, 2, sink, recent)  # the prefix's own sink is [0, 2)
    alive = [True] * 4 + [False] * 10 + [True] * 6
    assert rs.reusable(alive, 20, sink, recent)  # [16, 20) is the window: recent - 1 keys
    assert rs.reusable(alive, 18, sink, recent)  # [14, 18)
    assert not rs.reusable(alive, 17, sink, recent)  # 13 is gone
    assert not rs.reusable(alive, 21, sink, recent)  # longer than what is cached


def _path(rng: random.Random, sink_stop: int) -> list[tuple[int, bool]]:
    nodes, depth = [], 0
    while depth < 60:
        length = rng.randint(1, 12)
        nodes.append((length, rng.random() < 0.7 or depth >= sink_stop and rng.random() < 0.3))
        depth += length
    return nodes


def test_incremental_match_equals_the_reference_on_random_paths() -> None:
    rng = random.Random(7)
    sink, recent = 6, 9
    for _ in range(2000):
        nodes = _path(rng, sink)
        alive = [flag for length, flag in nodes for _ in range(length)]
        match = rs.SinkWindowMatch(sink_stop=sink, window=recent - 1)
        depth = 0
        for length, flag in nodes:
            depth += length
            assert match.accept(length, flag) == rs.reusable(alive, depth, sink, recent), (
                nodes, depth)
