"""Deferred submission, pure: requests wait in the proxy and are released just in time.

Requests wait in one queue ordered by a score (an ``Order``, from a registry: prompt length
against waiting time, or arrival order). ``pump`` walks the queue best first; each request's
best instance is the one its ``Estimate`` prefers (lowest predicted TTFT). The request is released
when that instance is *open* — its predicted backlog is within ``lead`` of its next batch
boundary, or it has nothing at all — so the next batch is formed from the best requests known at
that moment, and late arrivals can overtake. A request whose best instance is busy stays, and the
walk goes on (a short request can pass a long one). No starvation: a request that has waited one
predicted batch cycle plus ``bound_cycles`` cycles is released at once to its best instance
(``overdue``), oldest first, whatever that instance's state: ``max_hold`` = cycle × (1 + bound).

Work conservation: the prediction may be wrong, and a wrong "busy" would leave an instance
without work while requests wait here. An optional ``starved`` test says an instance is short of
work whatever its prediction (e.g. it reports nothing waiting, or less than two batches were sent
to it and are not back); such an instance is open, and a request whose best instance is busy goes
to the best of the starved instances instead of waiting. These releases count as ``starved``.
An optional ``redirect_wait`` makes that move pay for itself: a request goes to a starved
instance only once it has waited as long as the extra compute it would cost there (its cached
prefix lives elsewhere) -- the ski-rental rule: while its own instance may open any moment,
waiting is cheap; past that point, recomputing is. Without a cache difference the wait is zero.
Such a costly move comes last: the walk first serves every request whose best instance is open
(a starved instance included), and only the capacity that leaves takes a redirected request, so
a move that recomputes a prefix never pushes out a request whose prefix is cached there.

Nothing here does I/O or reads a clock; the caller passes ``now`` and acts on what ``pump``
returns.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random
from collections.abc import Callable, Sequence
from typing import Any, Protocol


@dataclasses.dataclass(slots=True)
class Waiting:
    """A request held in the proxy."""

    key: str
    tokens: int  # prompt tokens
    work: float  # predicted compute seconds on its best instance (what "length" means here)
    arrival: float
    payload: Any = None


class Instance(Protocol):
    key: str

    def queue_seconds(self, now: float) -> float: ...

    def cycle_seconds(self, default: float) -> float: ...

    def is_idle(self) -> bool: ...


# cost of ``item`` on ``instance`` (lower is better; None: not allowed there)
Estimate = Callable[[Waiting, Instance, float], Any]
Order = Callable[[Sequence[Waiting], float], list[Waiting]]  # (items, now) -> best first
Gate = Callable[[Instance, float], bool]  # may this instance take work now?

_ORDERS: dict[str, Order] = {}


def register_order(name: str) -> Callable[[Order], Order]:
    def wrap(fn: Order) -> Order:
        _ORDERS[name] = fn
        return fn

    return wrap


def get_order(name: str) -> Order:
    try:
        return _ORDERS[name]
    except KeyError:
        raise ValueError(f"unknown queue order {name!r}; known: {', '.join(sorted(_ORDERS))}") from None


@register_order("fifo")
def fifo(items: Sequence[Waiting], now: float) -> list[Waiting]:
    """Arrival order (no resorting)."""
    return sorted(items, key=lambda w: w.arrival)


@register_order("short_old_first")
def short_old_first(items: Sequence[Waiting], now: float) -> list[Waiting]:
    """Score = waiting time − 2 × predicted compute, highest first: short jobs first, aged.

    Both terms are seconds, so the trade-off does not depend on the clock's speed: a request
    that needs one second more compute than another goes after it unless it has waited two
    seconds longer. Compute is of the *uncached* tokens, so a long prompt mostly in cache
    counts as short.
    """
    return sorted(items, key=lambda w: (now - w.arrival) - 2.0 * w.work, reverse=True)


@register_order("shortest_first")
def shortest_first(items: Sequence[Waiting], now: float) -> list[Waiting]:
    """Least predicted compute first, arrival order among equals (no aging: the hold bound is
    what protects long requests)."""
    return sorted(items, key=lambda w: (w.work, w.arrival))


@register_order("upstream_weights")
def upstream_weights(items: Sequence[Waiting], now: float) -> list[Waiting]:
    """OmniInfer's shipped order: 0.8·(Tmax−T)/Tmax + 0.2·W/Wmax (Wmax ≥ 50 ms), highest first."""
    t_max = max((w.tokens for w in items), default=1) or 1
    w_max = max([0.050, *(now - w.arrival for w in items)])
    return sorted(items, key=lambda w: 0.8 * (t_max - w.tokens) / t_max
                  + 0.2 * (now - w.arrival) / w_max, reverse=True)


def slo_first(order: Order, slo_s: float,
              queue_wait: Callable[[float], float] | None = None) -> Order:
    """``order`` among requests that can still meet a TTFT objective, then the others, oldest
    first.

    Under overload the mean wait is set by the load, whatever the order; the order decides how
    many requests finish within the objective. A request that has already waited past it
    (waiting time + its predicted compute > ``slo_s``) would, served first, make the next ones
    miss as well; it goes after them, and the hold bound still releases it in time. With
    ``queue_wait`` (now -> the seconds a request released now waits at the soonest instance),
    that wait counts too: a request that would pass the objective in an instance's queue is
    late already.
    """

    def ordered(items: Sequence[Waiting], now: float) -> list[Waiting]:
        alive: list[Waiting] = []
        late: list[Waiting] = []
        ahead = 0.0 if queue_wait is None else max(0.0, queue_wait(now))
        for w in items:
            (alive if (now - w.arrival) + ahead + w.work <= slo_s else late).append(w)
        return order(alive, now) + sorted(late, key=lambda w: w.arrival)

    return ordered


# (now) -> (instances working in parallel, predicted seconds of work already sent to each)
Capacity = Callable[[float], tuple[int, float]]


def load_adaptive(slo_s: float, capacity: Capacity, threshold: float = 0.5,
                  calm: float | None = None) -> Order:
    """Short and old first while the cluster keeps up; shortest first once it does not.

    The waiting requests' predicted compute spread over the instances is the time the router's
    queue needs to drain. While it is under ``threshold`` × the objective, aging keeps the tail
    short (``short_old_first``); beyond it the requests cannot all meet the objective whatever
    the order, and serving the shortest first keeps the most of them within it
    (``shortest_first``). Once there, it stays until the drain time is under ``calm`` × the
    objective (default: ``threshold``), so that a queue hovering at the threshold does not
    hand its capacity back and forth between the two orders.
    """
    leave = threshold if calm is None else min(calm, threshold)
    overloaded = False

    def ordered(items: Sequence[Waiting], now: float) -> list[Waiting]:
        nonlocal overloaded
        servers, _ = capacity(now)
        drain = sum(w.work for w in items) / max(1, servers)
        overloaded = drain > (leave if overloaded else threshold) * slo_s
        if overloaded:
            return shortest_first(items, now)
        return short_old_first(items, now)

    return ordered


def slo_sacrifice(slo_s: float, capacity: Capacity) -> Order:
    """Most requests within a TTFT objective: Moore–Hodgson over the waiting queue.

    The instances are treated as one machine ``n`` times as fast. In deadline order (oldest
    first: every request has the same objective) the queue's predicted finish times are
    accumulated; whenever one would finish past its deadline, the longest request kept so far
    is given up — it goes after the others — which is the rule that maximises the number of
    requests on time on one machine. Given-up requests and those already past the objective
    follow, oldest first; the hold bound still releases them in time. Under light load nothing
    is given up and this is first come, first served.
    """

    def ordered(items: Sequence[Waiting], now: float) -> list[Waiting]:
        servers, backlog = capacity(now)
        servers = max(1, servers)
        kept: list[Waiting] = []
        heap: list[tuple[float, float, str]] = []  # (-work, arrival, key): the longest on top
        dropped: set[str] = set()
        late: list[Waiting] = []
        finish = max(0.0, backlog)
        for w in sorted(items, key=lambda w: (w.arrival, w.key)):
            if (now - w.arrival) + w.work > slo_s:
                late.append(w)
                continue
            kept.append(w)
            heapq.heappush(heap, (-w.work, w.arrival, w.key))
            finish += w.work / servers
            if (now - w.arrival) + finish + w.work * (1.0 - 1.0 / servers) > slo_s:
                work, _, key = heapq.heappop(heap)
                dropped.add(key)
                finish += work / servers  # work is negative: the finish time moves earlier
        given_up = [w for w in kept if w.key in dropped]
        return ([w for w in kept if w.key not in dropped]
                + sorted(given_up + late, key=lambda w: w.arrival))

    return ordered


@dataclasses.dataclass(frozen=True)
class DeferralOptions:
    lead_fraction: float = 1.0  # release when the backlog is within this share of a cycle
    bound_cycles: float = 8.0  # after one cycle + this many: overdue
    default_cycle: float = 0.2  # seconds, until a cycle has been measured
    min_cycle: float = 1e-3


@dataclasses.dataclass(slots=True)
class Release:
    item: Waiting
    instance: Instance
    reason: str  # "open", "idle", "starved" or "overdue"
    estimate: Any


class DeferredQueue:
    """The proxy-side queue and its release rule (see the module docstring).

    ``gate`` says whether an instance may take work now (default: the just-in-time rule,
    ``is_open``); with ``choose_among_open`` the best instance is sought among open ones only
    (OmniInfer's shipped rule: skip overloaded instances), otherwise among all, and the
    request waits while its best instance is closed.
    """

    def __init__(self, order: Order, estimate: Estimate,
                 options: DeferralOptions = DeferralOptions(),
                 rng: random.Random | None = None, gate: Gate | None = None,
                 choose_among_open: bool = False, starved: Gate | None = None,
                 redirect_wait: Callable[[Waiting, Instance], float] | None = None) -> None:
        self.order = order
        self.estimate = estimate
        self.options = options
        self.rng = rng or random.Random()
        self.starved = starved
        self.redirect_wait = redirect_wait
        self._redirect_at = math.inf  # the earliest held redirect becomes due (next_wakeup)
        self.gate: Gate = gate or self.is_open
        self.choose_among_open = choose_among_open
        self.items: dict[str, Waiting] = {}

    def __len__(self) -> int:
        return len(self.items)

    def push(self, item: Waiting) -> None:
        self.items[item.key] = item

    def remove(self, key: str) -> Waiting | None:
        return self.items.pop(key, None)

    # ---- timing -----------------------------------------------------------------------------
    def cycle(self, instances: Sequence[Instance]) -> float:
        o = self.options
        cycles = [i.cycle_seconds(o.default_cycle) for i in instances] or [o.default_cycle]
        return max(o.min_cycle, sum(cycles) / len(cycles))

    def max_hold(self, instances: Sequence[Instance]) -> float:
        """The longest any request stays: one predicted batch cycle plus the bound (overdue)."""
        return self.cycle(instances) * (1.0 + self.options.bound_cycles)

    def lead(self, instance: Instance) -> float:
        o = self.options
        return o.lead_fraction * max(o.min_cycle, instance.cycle_seconds(o.default_cycle))

    def is_due(self, instance: Instance, now: float) -> bool:
        """The just-in-time rule alone: idle, or the predicted backlog within one lead."""
        return instance.is_idle() or instance.queue_seconds(now) <= self.lead(instance)

    def is_open(self, instance: Instance, now: float) -> bool:
        """Due by the prediction, or reported starved (work conservation)."""
        return self.is_due(instance, now) or self._is_starved(instance, now)

    # ---- the release rule -------------------------------------------------------------------
    def best(self, item: Waiting, instances: Sequence[Instance], now: float
             ) -> tuple[Instance, Any] | None:
        """Lowest estimate (e.g. predicted TTFT); exact ties broken at random."""
        scored = [(self.estimate(item, inst, now), inst) for inst in instances]
        scored = [(s, inst) for s, inst in scored if s is not None]
        if not scored:
            return None
        low = min(s for s, _ in scored)
        ties = [inst for s, inst in scored if s == low]
        return self.rng.choice(ties), low

    def pump(self, now: float, instances: Sequence[Instance],
             on_release: Callable[[Release], None] | None = None) -> list[Release]:
        """Release every request that should go now, best score first.

        ``on_release`` runs right after each decision (the caller books the request on the
        instance there, so the next decision sees the new backlog).
        """
        self._redirect_at = math.inf
        if not self.items or not instances:
            return []
        hold = self.max_hold(instances)
        forced: list[Waiting] = []  # past the hold bound: released at once
        fresh: list[Waiting] = []
        for w in self.items.values():
            (forced if now - w.arrival >= hold - 1e-9 else fresh).append(w)
        forced.sort(key=lambda w: w.arrival)
        out: list[Release] = []
        for item in forced:
            found = self.best(item, instances, now)
            if found is not None:
                out.append(self._release(item, found[0], "overdue", found[1], on_release))
        # an instance's gate changes only when it is given work, so it is evaluated once per
        # instance and again after each release there (the walk is O(queue × instances))
        is_open = {id(i): self.gate(i, now) for i in instances}
        is_starved = {id(i): self._is_starved(i, now) for i in instances}
        costly: list[Waiting] = []  # would recompute a prefix cached elsewhere: second pass

        def release(item: Waiting, inst: Instance, reason: str, estimate: Any) -> None:
            out.append(self._release(item, inst, reason, estimate, on_release))
            is_open[id(inst)] = self.gate(inst, now)
            is_starved[id(inst)] = self._is_starved(inst, now)

        for item in self.order(fresh, now):
            open_now = [i for i in instances if is_open[id(i)]]
            if not open_now:
                break
            found = self.best(item, open_now if self.choose_among_open else instances, now)
            reason = None if found is None else self._reason(found[0], now, is_open[id(found[0])])
            if reason is None:  # its best instance is busy: an instance short of work takes it
                found = self._redirect(item, instances, is_starved, now, costly)
                reason = None if found is None else "starved"
            if found is not None and reason is not None:
                release(item, found[0], reason, found[1])
        # A redirect that recomputes takes only what the requests preferring an instance left
        for item in costly:
            found = self._redirect(item, instances, is_starved, now, None)
            if found is not None:
                release(item, found[0], "starved", found[1])
        return out

    def _redirect(self, item: Waiting, instances: Sequence[Instance], is_starved: dict[int, bool],
                  now: float, costly: list[Waiting] | None) -> tuple[Instance, Any] | None:
        """The starved instance ``item`` may move to now, its best being busy (None: it waits).

        A move that costs no recompute goes at once. One that recomputes a prefix cached
        elsewhere is put on ``costly`` during the first pass (so every request that prefers
        the starved instance is served there first) and, in the second pass (``costly`` None),
        goes once it has waited as long as that recompute (the ski-rental rule).
        """
        starved = [i for i in instances if is_starved[id(i)]]
        found = self.best(item, starved, now) if starved else None
        if found is None or self.redirect_wait is None:
            return found
        wait = self.redirect_wait(item, found[0])
        if wait <= 0.0:
            return found
        if costly is not None:
            costly.append(item)
            return None
        ready = item.arrival + wait
        if now < ready - 1e-9:  # not yet worth its recompute: wait for its own
            self._redirect_at = min(self._redirect_at, ready)
            return None
        return found

    def _is_starved(self, inst: Instance, now: float) -> bool:
        return self.starved is not None and self.starved(inst, now)

    def _reason(self, inst: Instance, now: float, is_open: bool) -> str | None:
        """Why ``inst`` may take work now (None: it may not)."""
        if self.choose_among_open:
            return "idle" if inst.is_idle() else "open"
        if inst.is_idle():
            return "idle"
        if not is_open:
            return None
        # the gate decides; the reason says whether the prediction or the starvation opened it
        due = self.is_due(inst, now)
        return "starved" if not due and self._is_starved(inst, now) else "open"

    def _release(self, item: Waiting, inst: Instance, reason: str, estimate: Any,
                  on_release: Callable[[Release], None] | None) -> Release:
        del self.items[item.key]
        release = Release(item, inst, reason, estimate)
        if on_release is not None:
            on_release(release)
        return release

    def next_wakeup(self, now: float, instances: Sequence[Instance]) -> float | None:
        """When ``pump`` may next release something without any new event (None: never)."""
        if not self.items or not instances:
            return None
        hold = self.max_hold(instances)
        times = [min(w.arrival for w in self.items.values()) + hold, self._redirect_at]
        for inst in instances:
            wait = inst.queue_seconds(now) - self.lead(inst)
            times.append(now + max(0.0, wait))
        first = min(times)
        return None if first == math.inf else max(now, first)
