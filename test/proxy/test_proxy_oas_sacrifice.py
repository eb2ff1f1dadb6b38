"""The Moore–Hodgson order (``slo_sacrifice``, the ``oas_mh`` variant): first come, first
served while everything fits; otherwise the requests that would make others miss the objective
are given up, as many on time as the best schedule of one machine."""

from __future__ import annotations

import itertools
import random

from omniinfer.proxy.oas.deferred_queue import Waiting, get_order, slo_sacrifice


def item(key: str, work: float, arrival: float, tokens: int = 1000) -> Waiting:
    return Waiting(key, tokens, work, arrival)


def _on_time(order: list[Waiting], now: float, slo: float, servers: int = 1) -> int:
    """Requests within the objective when served in this order by ``servers`` equal machines
    (each next request to the machine free first)."""
    free = [0.0] * servers
    count = 0
    for w in order:
        i = min(range(servers), key=free.__getitem__)
        free[i] += w.work
        count += (now - w.arrival) + free[i] <= slo + 1e-12
    return count


def test_slo_sacrifice_is_first_come_first_served_when_everything_fits() -> None:
    order = slo_sacrifice(2.0, lambda now: (2, 0.0))
    items = [item(f"r{i}", 0.1, 0.01 * (9 - i)) for i in range(10)]
    assert [w.key for w in order(items, 0.2)] == [f"r{i}" for i in reversed(range(10))]


def test_slo_sacrifice_gives_up_the_long_request_that_would_make_the_others_late() -> None:
    long, shorts = item("long", 1.5, 0.0), [item(f"s{i}", 0.2, 0.1 * (i + 1)) for i in range(4)]
    lost = item("lost", 0.1, -3.0)  # already past the objective
    keys = [w.key for w in slo_sacrifice(2.0, lambda now: (1, 0.0))([lost, long, *shorts], 0.5)]
    assert keys == ["s0", "s1", "s2", "s3", "lost", "long"]
    fifo = get_order("fifo")([long, *shorts], 0.5)
    assert _on_time(fifo, 0.5, 2.0) == 1  # served first, the long one makes every short one late
    kept = [w for w in slo_sacrifice(2.0, lambda now: (1, 0.0))([long, *shorts], 0.5)]
    assert _on_time(kept, 0.5, 2.0) == 4


def test_slo_sacrifice_keeps_the_most_requests_possible_on_one_machine() -> None:
    """Against every subset of small random queues: as many on time as the best schedule."""
    rng = random.Random(7)
    for _ in range(200):
        now, slo = 1.0, rng.uniform(0.5, 2.0)
        items = [item(f"r{i}", rng.choice([0.05, 0.2, 0.6, 1.2]), rng.uniform(-0.5, 1.0))
                 for i in range(6)]
        best = 0
        for k in range(len(items), 0, -1):
            if any(_on_time(sorted(sub, key=lambda w: w.arrival), now, slo) == k
                   for sub in itertools.combinations(items, k)):
                best = k
                break
        ordered = slo_sacrifice(slo, lambda now: (1, 0.0))(items, now)
        assert _on_time(ordered, now, slo) == best
        assert sorted(w.key for w in ordered) == sorted(w.key for w in items)


def test_slo_sacrifice_counts_the_backlog_already_sent() -> None:
    items = [item("a", 0.2, 0.9), item("b", 0.2, 0.95)]
    assert [w.key for w in slo_sacrifice(1.0, lambda now: (1, 0.0))(items, 1.0)] == ["a", "b"]
    # 0.7 s already queued at the instance: only one of the two can still make it
    # (of two equal ones, the one given up is the one the heap holds first: the older)
    keys = [w.key for w in slo_sacrifice(1.0, lambda now: (1, 0.7))(items, 1.0)]
    assert keys == ["b", "a"]
