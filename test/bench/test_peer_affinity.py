"""The peer-affinity check's ideal: what perfect prefix affinity would keep cached."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark" / "proxy"))

import peer_affinity  # noqa: E402

from omniinfer.bench.prefix_workloads import prefix_groups  # noqa: E402
from omniinfer.bench.workloads import WorkloadSpec  # noqa: E402


def test_ideal_share_counts_every_visit_of_a_group_but_its_first() -> None:
    spec = WorkloadSpec(num_requests=12, output_len=4, prefix_len=100, num_groups=3,
                        users_per_group=4, query_len=20)
    requests = prefix_groups(spec)
    # 12 requests of 120 tokens; 3 first visits pay the prefix, 9 reuse 100 tokens each
    assert peer_affinity.ideal_share(requests, 100) == pytest.approx(900 / 1440)


def test_ideal_share_is_zero_when_no_group_repeats() -> None:
    spec = WorkloadSpec(num_requests=4, output_len=4, prefix_len=50, num_groups=4,
                        users_per_group=1, query_len=10)
    assert peer_affinity.ideal_share(prefix_groups(spec), 50) == 0.0
