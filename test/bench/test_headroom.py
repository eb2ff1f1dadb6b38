"""benchmark/proxy/headroom.py: the misses no prefill order avoids in a closed loop's opening burst."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark" / "proxy"))

import headroom  # noqa: E402


def test_forced_misses_take_the_longest_prompts_past_the_objective() -> None:
    # 10,000 tokens at 4,000 tokens/s: 8,000 fit in 2 s, the rest (2,000) is covered by the
    # longest prompt alone
    assert headroom.forced_misses([5000, 3000, 1000, 1000], 4000.0, 2.0) == 1
    # 5,000 left over: the longest prompt (2,500) is not enough, two are
    assert headroom.forced_misses([2500, 2500, 2500, 2500, 1000], 3000.0, 2.0) == 2
    assert headroom.forced_misses([1000, 1000], 4000.0, 2.0) == 0  # everything fits


def test_the_opening_prompts_are_the_workloads_first_requests() -> None:
    meta = {"num_requests": 4, "requests_per_client": 1, "seed": 0, "output_scale": 0.05}
    first = headroom.opening_prompts(meta, 3)
    longer = headroom.opening_prompts({**meta, "num_requests": 8}, 3)
    assert len(first) == 3 and first == longer and all(n > 0 for n in first)
