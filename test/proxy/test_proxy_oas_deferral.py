"""Deferred submission: order, the just-in-time release, hold bounds and starvation freedom."""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Iterator

import pytest

from omniinfer.proxy.oas.deferred_queue import (
    DeferralOptions,
    DeferredQueue,
    Release,
    Waiting,
    get_order,
    slo_first,
    upstream_weights,
)


@dataclasses.dataclass
class FakeInstance:
    key: str
    backlog: float = 0.0  # predicted seconds of work already sent
    cycle: float = 0.1
    idle: bool = False

    def queue_seconds(self, now: float) -> float:
        return self.backlog

    def cycle_seconds(self, default: float) -> float:
        return self.cycle

    def is_idle(self) -> bool:
        return self.idle


def ttft(item: Waiting, inst: FakeInstance, now: float) -> float:  # type: ignore[override]
    return inst.backlog + item.work


def item(key: str, work: float, arrival: float, tokens: int = 1000) -> Waiting:
    return Waiting(key, tokens, work, arrival)


def test_short_old_first_reorders_the_queue_against_arrival_and_length() -> None:
    """Arrival order is long, short, late. ``short`` overtakes ``long``: it needs 0.49 s less
    compute and arrived only 0.2 s later. ``late`` does not: it arrived 1.2 s later, more than
    twice the compute difference. So neither arrival order (fifo) nor length alone
    (shortest_first) gives this order. Both terms age alike, so two waiting requests never swap
    while they wait; only an arrival can overtake."""
    long, short, late = item("long", 0.5, 0.0), item("short", 0.01, 0.2), item("late", 0.01, 1.2)
    for now in (1.3, 5.0, 50.0):
        assert [w.key for w in get_order("short_old_first")([late, long, short], now)] == [
            "short", "long", "late"]
    assert [w.key for w in get_order("shortest_first")([late, long, short], 1.3)] == [
        "short", "late", "long"]
    # the queue releases in its order, one open slot at a time; fifo keeps arrival order
    for name, expected in (("short_old_first", ["short", "long", "late"]),
                           ("fifo", ["long", "short", "late"])):
        inst = FakeInstance("a", backlog=10.0, cycle=0.1)  # busy except when a slot opens
        q = DeferredQueue(get_order(name), ttft, DeferralOptions(bound_cycles=100.0))
        for w in (long, short, late):
            q.push(w)
        released = []
        for now in (1.3, 1.4, 1.5):
            inst.idle = True
            out = q.pump(now, [inst], lambda r, inst=inst: setattr(inst, "idle", False))
            released += [(r.item.key, r.reason) for r in out]
        assert released == [(key, "idle") for key in expected], name


def test_slo_first_puts_requests_that_can_still_make_it_ahead_of_lost_ones() -> None:
    order = slo_first(get_order("short_old_first"), slo_s=2.0)
    lost = item("lost", 0.1, 0.0)  # waited 2.5 s: can no longer make 2 s
    old_long = item("old_long", 0.8, 1.0)  # 1.5 s + 0.8 s > 2 s: lost as well
    fresh_long, fresh_short = item("fresh_long", 1.0, 2.3), item("fresh_short", 0.1, 2.4)
    keys = [w.key for w in order([lost, old_long, fresh_long, fresh_short], 2.5)]
    # the ones that can make it, short-old-first among them; then the lost ones, oldest first
    assert keys == ["fresh_short", "fresh_long", "lost", "old_long"]
    # plain short-old-first would serve the lost one first (it has aged most)
    assert [w.key for w in get_order("short_old_first")([lost, fresh_short], 2.5)][0] == "lost"


def test_slo_first_with_the_queue_counts_an_instance_queue_as_waiting() -> None:
    """EDF among those alive (``oas_edf``): a request alive by its own wait but not once the
    soonest instance's queue is added goes with the lost ones; FIFO among the rest."""
    young, old = item("young", 0.5, 2.0), item("old", 0.5, 1.0)  # at 2.5: waited 0.5 / 1.5 s
    plain = slo_first(get_order("fifo"), slo_s=2.0)
    assert [w.key for w in plain([young, old], 2.5)] == ["old", "young"]
    queued = slo_first(get_order("fifo"), slo_s=2.0, queue_wait=lambda now: 0.4)
    # old: 1.5 + 0.4 + 0.5 > 2 -> late; young: 0.5 + 0.4 + 0.5 <= 2 -> alive, served first
    assert [w.key for w in queued([young, old], 2.5)] == ["young", "old"]
    idle = slo_first(get_order("fifo"), slo_s=2.0, queue_wait=lambda now: -1.0)  # never < 0
    assert [w.key for w in idle([young, old], 2.5)] == ["old", "young"]


def _wakeups(q: DeferredQueue, now: float, instances: list[FakeInstance],
             until: float = math.inf) -> Iterator[float]:
    """The queue's own wake-up times up to ``until`` (by default: until it is empty); the
    caller pumps at each. Fails, rather than loops for ever, if requests are never released."""
    for _ in range(10_000):
        if not len(q):
            return
        wake = q.next_wakeup(now, instances)
        assert wake is not None or until < math.inf  # draining: a release is due some time
        if wake is None or wake > until:
            return
        now = wake
        yield now
    pytest.fail(f"{len(q)} requests never released")


def _drive(q: DeferredQueue, inst: FakeInstance, rng: random.Random, rate: float,
           works: tuple[float, ...], opens: Callable[[int], None], taken: Callable[[], None]
           ) -> list[tuple[str, str, float]]:
    """300 Poisson arrivals at ``rate`` with random work from ``works`` to one instance; the
    queue is pumped at each arrival (after ``opens(i)`` may free a slot) and whenever it asks
    to be woken, then drained. ``taken`` runs at each release. Returns (key, reason, held)."""
    clock, arrivals, held = [0.0], {}, []

    def take(r: Release) -> None:
        taken()
        held.append((r.item.key, r.reason, clock[0] - arrivals[r.item.key]))

    for i in range(300):
        arrival = clock[0] + rng.expovariate(rate)
        for wake in _wakeups(q, clock[0], [inst], until=arrival):
            clock[0] = wake
            q.pump(wake, [inst], take)
        clock[0] = arrival
        key = f"r{i}"
        q.push(item(key, rng.choice(works), arrival))
        arrivals[key] = arrival
        opens(i)
        q.pump(arrival, [inst], take)
    inst.idle = False
    for wake in _wakeups(q, clock[0], [inst]):
        clock[0] = wake
        q.pump(wake, [inst], take)
    return held


@pytest.mark.parametrize("seed", [0, 1])
def test_slo_first_keeps_the_hold_bound(seed: int) -> None:
    """Overloaded: one slot opens per arrival, half the requests arrive; the lost ones go last,
    yet none waits past one cycle plus the bound, and most releases go to fresh requests."""
    rng = random.Random(seed)
    opts = DeferralOptions(lead_fraction=1.0, bound_cycles=3.0)
    inst = FakeInstance("a", backlog=10.0, cycle=0.2)
    q = DeferredQueue(slo_first(get_order("short_old_first"), 0.3), ttft, opts, rng)
    bound = q.max_hold([inst])

    def opens(i: int) -> None:
        inst.idle = i % 2 == 0  # one slot at every second arrival

    def taken() -> None:
        inst.idle = False

    held = _drive(q, inst, rng, 40.0, (0.001, 0.04), opens, taken)
    assert len(held) == 300 and max(h for *_, h in held) <= bound + 1e-9
    fresh = [h for _, reason, h in held if reason == "idle"]
    assert len(fresh) >= 140 and sum(h <= 0.3 for h in fresh) / len(fresh) > 0.9


def test_shortest_first_ignores_waiting_time() -> None:
    old_long, new_short = item("old_long", 0.5, 0.0), item("new_short", 0.05, 9.0)
    tie_late, tie_early = item("tie_late", 0.05, 9.5), item("tie_early", 0.05, 8.0)
    keys = [w.key for w in get_order("shortest_first")([old_long, new_short, tie_late, tie_early],
                                                      10.0)]
    assert keys == ["tie_early", "new_short", "tie_late", "old_long"]


def test_upstream_order_is_the_shipped_formula() -> None:
    a, b = item("a", 0, 0.0, tokens=8000), item("b", 0, 0.9, tokens=1000)
    # a: 0.8*0 + 0.2*1.0 = 0.2 ; b: 0.8*(7/8) + 0.2*(0.1/1.0) = 0.72
    assert [w.key for w in upstream_weights([a, b], 1.0)] == ["b", "a"]
    with pytest.raises(ValueError, match="unknown queue order"):
        get_order("nope")


def test_release_waits_for_the_batch_boundary_then_fills_the_best_instance() -> None:
    inst = FakeInstance("w", backlog=0.5, cycle=0.1)
    q = DeferredQueue(get_order("short_old_first"), ttft, DeferralOptions(lead_fraction=1.0))
    q.push(item("a", 0.05, 0.0))
    assert q.pump(0.0, [inst]) == []  # 0.5 s of work queued: the next boundary is far
    wake = q.next_wakeup(0.0, [inst])
    assert wake == pytest.approx(0.0 + 0.5 - 0.1)  # just before the boundary
    inst.backlog = 0.08  # within one cycle of the boundary
    out = q.pump(0.4, [inst])
    assert [(r.item.key, r.reason) for r in out] == [("a", "open")] and len(q) == 0


def test_short_request_overtakes_and_busy_best_instance_holds_only_its_requests() -> None:
    fast, slow = FakeInstance("fast"), FakeInstance("slow", backlog=1.0)

    def cached_on_slow(w: Waiting, inst: FakeInstance, now: float) -> float:
        cost = ttft(w, inst, now)
        return cost - 2.0 if (w.key == "cached" and inst.key == "slow") else cost

    q = DeferredQueue(get_order("short_old_first"), cached_on_slow)
    q.push(item("cached", 0.3, 0.0))
    q.push(item("short", 0.01, 0.05))
    out = q.pump(0.06, [fast, slow])
    assert [r.item.key for r in out] == ["short"]  # the cached one waits for its instance
    assert "cached" in q.items


def test_random_tie_break_uses_every_equal_instance() -> None:
    a, b = FakeInstance("a", idle=True), FakeInstance("b", idle=True)
    q = DeferredQueue(get_order("fifo"), ttft, rng=random.Random(1))
    chosen = set()
    for i in range(40):
        q.push(item(f"r{i}", 0.01, 0.0))
        chosen |= {r.instance.key for r in q.pump(0.0, [a, b])}
    assert chosen == {"a", "b"}


def test_none_estimate_excludes_an_instance() -> None:
    a, b = FakeInstance("a", idle=True), FakeInstance("b", idle=True)
    q = DeferredQueue(get_order("fifo"),
                      lambda w, i, now: None if i.key == "a" else ttft(w, i, now))
    q.push(item("x", 0.1, 0.0))
    assert [r.instance.key for r in q.pump(0.0, [a, b])] == ["b"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_request_is_held_longer_than_one_cycle_plus_the_bound(seed: int) -> None:
    """Instances never open (always busy), shorts keep arriving: everyone still leaves in time."""
    rng = random.Random(seed)
    opts = DeferralOptions(lead_fraction=1.0, bound_cycles=3.0)
    insts = [FakeInstance("a", backlog=10.0, cycle=0.2), FakeInstance("b", backlog=10.0, cycle=0.3)]
    q = DeferredQueue(get_order("short_old_first"), ttft, opts, rng)
    bound = q.max_hold(insts)
    assert bound == pytest.approx(0.25 * (1 + 3.0))
    now, arrivals, held = 0.0, {}, []
    q.push(item("long", 5.0, 0.0))
    arrivals["long"] = 0.0
    for i in range(400):
        arrival = now + rng.expovariate(20.0)
        for wake in _wakeups(q, now, insts, until=arrival):  # timers before the next arrival
            held += [(r.item.key, wake - arrivals[r.item.key]) for r in q.pump(wake, insts)]
        now = arrival
        key = f"s{i}"
        q.push(item(key, 0.001, now))
        arrivals[key] = now
        held += [(r.item.key, now - arrivals[r.item.key]) for r in q.pump(now, insts)]
    for wake in _wakeups(q, now, insts):
        held += [(r.item.key, wake - arrivals[r.item.key]) for r in q.pump(wake, insts)]
    assert len(held) == 401 and any(k == "long" for k, _ in held)
    assert max(h for _, h in held) <= bound + 1e-9


def test_a_gate_that_is_always_open_releases_at_once_to_the_best_instance() -> None:
    """``oas_no_defer``: the gate alone decides, so a request goes to its best instance at
    once, although the prediction says that instance is busy and it is not short of work."""
    busy, busier = FakeInstance("busy", backlog=5.0), FakeInstance("busier", backlog=9.0)
    q = DeferredQueue(get_order("short_old_first"), ttft, gate=lambda i, now: True)
    q.push(item("a", 0.1, 0.0))
    assert [(r.instance.key, r.reason) for r in q.pump(0.0, [busy, busier])] == [("busy", "open")]
    held = DeferredQueue(get_order("short_old_first"), ttft)  # the just-in-time rule holds it
    held.push(item("a", 0.1, 0.0))
    assert held.pump(0.0, [busy, busier]) == []


def test_gate_among_open_only_skips_overloaded_instances() -> None:
    full, free = FakeInstance("full", backlog=9.0), FakeInstance("free", backlog=5.0)
    q = DeferredQueue(get_order("upstream_weights"), lambda w, i, now: (-1 if i is full else 0),
                      DeferralOptions(bound_cycles=float("inf")),
                      gate=lambda i, now: i.backlog < 8.0, choose_among_open=True)
    q.push(item("x", 0.1, 0.0))
    assert [r.instance.key for r in q.pump(0.0, [full, free])] == ["free"]
    free.backlog = 9.0
    q.push(item("y", 0.1, 0.0))
    assert q.pump(100.0, [full, free]) == []  # upstream: held while every instance is overloaded


def test_starved_instance_gets_work_although_its_prediction_says_busy() -> None:
    """Work conservation: the old rule (prediction only) holds the request while the instance
    reports nothing waiting; the new one releases it there, as ``starved``."""
    wrong = FakeInstance("w", backlog=5.0, cycle=0.1)  # the model thinks 5 s of work is queued
    jit_only = DeferredQueue(get_order("short_old_first"), ttft)
    jit_only.push(item("a", 0.05, 0.0))
    assert jit_only.pump(0.1, [wrong]) == []
    reported = {"w"}
    q = DeferredQueue(get_order("short_old_first"), ttft,
                      starved=lambda inst, now: inst.key in reported)
    q.push(item("a", 0.05, 0.0))
    out = q.pump(0.1, [wrong])
    assert [(r.item.key, r.instance.key, r.reason) for r in out] == [("a", "w", "starved")]
    reported.clear()  # the credit is used up: the next one waits for the prediction again
    q.push(item("b", 0.05, 0.1))
    assert q.pump(0.2, [wrong]) == [] and "b" in q.items


def test_redirect_to_a_starved_instance_waits_as_long_as_the_recompute_it_costs() -> None:
    """Ski rental: ``a``'s prefix is cached on the busy instance; the starved one would
    recompute 0.3 s of it, so ``a`` waits 0.3 s for its own instance before moving. ``b`` has no
    cached prefix anywhere (no extra compute) and moves at once. ``next_wakeup`` is the moment
    ``a``'s wait runs out, so the move needs no other event."""
    own, starved = FakeInstance("own", backlog=5.0), FakeInstance("starved", backlog=5.0)
    extra = {"a": 0.3, "b": 0.0}

    def cost(w: Waiting, inst: FakeInstance, now: float) -> float:
        return 0.0 if inst is own else 1.0

    q = DeferredQueue(get_order("fifo"), cost, starved=lambda inst, now: inst is starved,
                      redirect_wait=lambda w, inst: extra[w.key] if inst is starved else 0.0)
    q.push(item("a", 0.05, 0.0))
    q.push(item("b", 0.05, 0.0))
    out = q.pump(0.1, [own, starved])
    assert [(r.item.key, r.instance.key) for r in out] == [("b", "starved")]
    assert q.next_wakeup(0.1, [own, starved]) == pytest.approx(0.3)
    assert q.pump(0.2, [own, starved]) == [] and "a" in q.items
    out = q.pump(0.3, [own, starved])
    assert [(r.item.key, r.instance.key, r.reason) for r in out] == [("a", "starved", "starved")]


def test_a_costly_redirect_takes_only_what_the_starved_instances_own_requests_leave() -> None:
    """``old`` (first in the order) has its prefix on the busy instance and has waited past its
    recompute; ``mine`` has its prefix on the starved instance, which has room for one more
    request. ``mine`` goes there, and ``old`` keeps waiting for its own instance rather than
    recompute its prefix in the place of a request cached there. Once ``mine`` is gone and
    the starved instance still has room, ``old`` moves."""
    busy, spare = FakeInstance("busy", backlog=5.0), FakeInstance("spare", backlog=5.0)
    room = {"spare": 1}
    home = {"old": busy, "mine": spare}

    def cost(w: Waiting, inst: FakeInstance, now: float) -> float:
        return 0.0 if inst is home[w.key] else 1.0

    def take(release: Release) -> None:
        room[release.instance.key] = room.get(release.instance.key, 0) - 1

    q = DeferredQueue(get_order("fifo"), cost,
                      starved=lambda inst, now: room.get(inst.key, 0) > 0,
                      redirect_wait=lambda w, inst: 0.0 if home[w.key] is inst else 0.3)
    q.push(item("old", 0.05, 0.0))
    q.push(item("mine", 0.05, 0.35))
    out = q.pump(0.4, [busy, spare], take)
    assert [(r.item.key, r.instance.key, r.reason) for r in out] == [("mine", "spare", "starved")]
    assert "old" in q.items
    room["spare"] = 1
    out = q.pump(0.5, [busy, spare], take)  # still inside the hold bound (0.9 s)
    assert [(r.item.key, r.instance.key, r.reason) for r in out] == [("old", "spare", "starved")]


def test_a_waiting_request_still_goes_to_its_own_instance_the_moment_it_opens() -> None:
    own, starved = FakeInstance("own", backlog=5.0), FakeInstance("starved", backlog=5.0)
    q = DeferredQueue(get_order("fifo"), lambda w, inst, now: 0.0 if inst is own else 1.0,
                      starved=lambda inst, now: inst is starved,
                      redirect_wait=lambda w, inst: 10.0)
    q.push(item("a", 0.05, 0.0))
    assert q.pump(0.1, [own, starved]) == []
    own.backlog = 0.0  # its batch is done: the prediction opens it
    out = q.pump(0.2, [own, starved])
    assert [(r.item.key, r.instance.key, r.reason) for r in out] == [("a", "own", "open")]


def test_starved_instance_takes_requests_whose_best_instance_is_busy_only() -> None:
    """A request whose best instance is open goes there; one whose best is busy goes to the
    starved instance rather than wait (the best of the starved ones)."""
    best_open, busy = FakeInstance("best_open"), FakeInstance("busy", backlog=5.0)
    starved = FakeInstance("starved", backlog=5.0)  # the prediction says busy too
    prefer = {"a": "best_open", "b": "busy"}

    def cost(w: Waiting, inst: FakeInstance, now: float) -> float:
        return 0.0 if inst.key == prefer[w.key] else (1.0 if inst.key == "starved" else 2.0)

    q = DeferredQueue(get_order("fifo"), cost, starved=lambda inst, now: inst is starved)
    q.push(item("a", 0.05, 0.0))
    q.push(item("b", 0.05, 0.1))
    out = q.pump(0.2, [best_open, busy, starved])
    assert [(r.item.key, r.instance.key, r.reason) for r in out] == [
        ("a", "best_open", "open"), ("b", "starved", "starved")]


@pytest.mark.parametrize("seed", [0, 1])
def test_bound_and_starvation_freedom_hold_with_work_conservation(seed: int) -> None:
    """Instances are randomly reported starved (at most one release each per report) and
    otherwise always busy: every request still leaves within one cycle plus the bound."""
    rng = random.Random(seed)
    insts = [FakeInstance("a", backlog=10.0, cycle=0.2), FakeInstance("b", backlog=10.0, cycle=0.3)]
    credit: dict[str, int] = {}
    q = DeferredQueue(get_order("short_old_first"), ttft, DeferralOptions(bound_cycles=3.0), rng,
                      starved=lambda inst, now: credit.get(inst.key, 0) > 0)
    bound = q.max_hold(insts)

    def take(release: Release) -> None:
        credit[release.instance.key] = max(0, credit.get(release.instance.key, 0) - 1)

    now, arrivals, held, reasons = 0.0, {}, [], set()
    for i in range(300):
        arrival = now + rng.expovariate(20.0)
        for wake in _wakeups(q, now, insts, until=arrival):  # timers before the next arrival
            out = q.pump(wake, insts, take)
            held += [wake - arrivals[r.item.key] for r in out]
            reasons |= {r.reason for r in out}
        now = arrival
        if rng.random() < 0.1:  # a loads report: nothing waiting there
            credit[rng.choice("ab")] = 1
        key = f"r{i}"
        q.push(item(key, rng.choice([0.001, 0.5]), now))
        arrivals[key] = now
        out = q.pump(now, insts, take)
        held += [now - arrivals[r.item.key] for r in out]
        reasons |= {r.reason for r in out}
    for wake in _wakeups(q, now, insts):
        out = q.pump(wake, insts, take)
        held += [wake - arrivals[r.item.key] for r in out]
    assert len(held) == 300 and {"starved", "overdue"} <= reasons
    assert max(held) <= bound + 1e-9


def _overloaded_shortest_first(seed: int) -> tuple[list[tuple[str, str, float]], float]:
    """300 arrivals; at each, 0, 1 or 2 slots open (capacity equal to the load, in bursts, so
    a queue comes and goes); shortest first. Returns (key, reason, held) per release and the
    bound."""
    rng = random.Random(seed)
    inst = FakeInstance("a", backlog=10.0, cycle=0.2)
    q = DeferredQueue(get_order("shortest_first"), ttft, DeferralOptions(bound_cycles=3.0), rng)
    slots = [0]

    def opens(i: int) -> None:
        slots[0] += rng.choice([0, 1, 2])
        inst.idle = slots[0] > 0

    def taken() -> None:
        slots[0] = max(0, slots[0] - 1)
        inst.idle = slots[0] > 0

    held = _drive(q, inst, rng, 10.0, (0.001, 0.5), opens, taken)
    return held, q.max_hold([inst])


def test_shortest_first_under_overload_keeps_the_hold_bound() -> None:
    """Shortest first has no aging: long requests would wait for ever while shorter ones keep
    coming. The bound forces them out (as ``overdue``), and none waits past ``max_hold``
    (eight random runs)."""
    forced = 0
    for seed in range(8):
        held, bound = _overloaded_shortest_first(seed)
        assert len(held) == 300 and max(h for *_, h in held) <= bound + 1e-9
        forced += sum(r == "overdue" for _, r, _ in held)
    assert forced > 20  # the bound is what released them, not a lull in arrivals
