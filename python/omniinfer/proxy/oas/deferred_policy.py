"""Async glue shared by the deferring policies (``oas``, ``omni_default``, ``omni_earliest_batch``).

Prefill role: ``schedule`` parks the request in a :class:`DeferredQueue` and awaits a future;
the queue is pumped on every arrival, every finished prefill, at the next predicted batch
boundary (one loop timer) and, for policies that use it, on every /v1/loads report; each release
resolves a future with the chosen worker. Decode
role: requests that arrive in the same loop tick are ordered longest first (LPT) and each goes
to the least-loaded decode worker below its running cap; beyond the cap they wait for a slot.
Subclasses only say *how*: the queue order, the gate, the estimate, the options.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
from collections.abc import Sequence
from typing import Any

from omniinfer.proxy.oas.cost import BatchTimeModel, InstanceClock, ObservedDelay
from omniinfer.proxy.oas.deferred_queue import DeferredQueue, Instance, Release, Waiting
from omniinfer.proxy.policy_api import Decision, Policy, PolicyContext, RouteRequest
from omniinfer.proxy.workers import Role, Worker


class MemoModel(BatchTimeModel):
    """The batch time model, remembering its one-request predictions until it next learns:
    one routing decision asks for the same one several times (the request's work, each
    instance's estimate, the queue once booked), each a small numpy product otherwise."""

    MEMO_SIZE = 4096

    def __post_init__(self) -> None:
        super().__post_init__()
        self._memo: dict[int, float] = {}
        self._memo_version = self.version

    def predict(self, tokens: Sequence[int]) -> float:
        if len(tokens) != 1:
            return super().predict(tokens)
        if self._memo_version != self.version or len(self._memo) >= self.MEMO_SIZE:
            self._memo.clear()
            self._memo_version = self.version
        seconds = self._memo.get(tokens[0])
        if seconds is None:
            seconds = self._memo[tokens[0]] = super().predict(tokens)
        return seconds


@dataclasses.dataclass(slots=True)
class Held:
    request: RouteRequest
    allowed: dict[str, Worker]
    future: asyncio.Future[Decision]
    min_uncached: int = 0  # tokens to prefill on its best-cached allowed worker


@dataclasses.dataclass(slots=True)
class _DecodeWait:
    weight: float
    seq: int
    request: RouteRequest
    workers: list[Worker]
    future: asyncio.Future[Decision]


class DeferringPolicy(Policy):
    """Deferred prefill submission plus LPT decode placement; see the module docstring."""

    uses_prefix = False
    lpt: bool = True  # decode: longest first within a tick (False: arrival order)
    decode_output_weight: float = 1.0  # LPT weight = prompt + w·max_tokens (OmniInfer's form)
    late_observed: bool = False  # measure release-to-prefill delays ("late" judged with them)

    def __init__(self, context: PolicyContext) -> None:
        super().__init__(context)
        self.rng = random.Random()
        self.clocks: dict[str, InstanceClock] = {}
        self.workers: dict[str, Worker] = {}
        # release to prefill end beyond the predicted compute; booked only where it is used
        self.delays = ObservedDelay() if self.late_observed else None
        self.queue = self.make_queue()
        self._timer: asyncio.TimerHandle | None = None
        self._decode_pending: list[_DecodeWait] = []
        self._decode_flush: asyncio.Handle | None = None
        self._seq = 0
        self.released: dict[str, int] = {}  # by reason, for /server_info and tests

    # ---- what subclasses choose -------------------------------------------------------------
    def make_queue(self) -> DeferredQueue:
        raise NotImplementedError

    def work_seconds(self, request: RouteRequest, worker: Worker) -> float:
        """Predicted compute of the request on the worker (the queue's notion of length)."""
        clock = self.clock(worker)
        return clock.model.predict([max(1, request.uncached_tokens(worker))])

    # ---- shared state -----------------------------------------------------------------------
    def clock(self, worker: Worker) -> InstanceClock:
        clock = self.clocks.get(worker.url)
        if clock is None:
            clock = self.clocks[worker.url] = InstanceClock(worker.url, MemoModel())
        return clock

    @staticmethod
    def now() -> float:
        return asyncio.get_running_loop().time()

    def allowed(self, item: Waiting, inst: Instance) -> Worker | None:
        held: Held = item.payload
        return held.allowed.get(inst.key)

    def placement(self, item: Waiting, inst: Instance
                  ) -> tuple[RouteRequest, Worker, InstanceClock] | None:
        """What an estimate reads: the held request, its worker on ``inst`` (None: not allowed
        there) and that instance's clock."""
        worker = self.allowed(item, inst)
        if worker is None:
            return None
        assert isinstance(inst, InstanceClock)
        return item.payload.request, worker, inst

    def pick(self, request: RouteRequest, workers: list[Worker]) -> Decision:
        """Synchronous fallback (no waiting): the worker the estimate prefers now."""
        item = self._waiting(request, workers, None)
        found = self.queue.best(item, [self.clock(w) for w in workers], 0.0)
        worker = workers[0] if found is None else self.workers[found[0].key]
        return Decision(worker, "immediate")

    # ---- scheduling -------------------------------------------------------------------------
    async def schedule(self, request: RouteRequest, workers: list[Worker]) -> Decision | None:
        if not workers:
            return None
        if self.context.role is Role.DECODE:
            return await self._schedule_decode(request, workers)
        future: asyncio.Future[Decision] = asyncio.get_running_loop().create_future()
        item = self._waiting(request, workers, future)
        self.queue.push(item)
        self._pump()
        try:
            return await future
        except asyncio.CancelledError:
            self.queue.remove(item.key)
            if future.done() and not future.cancelled():  # booked as the client left
                self.on_cancelled(request, future.result().worker)
            raise

    def _waiting(self, request: RouteRequest, workers: list[Worker],
                 future: asyncio.Future[Decision] | None) -> Waiting:
        for w in workers:
            self.workers[w.url] = w
            self.clock(w)
        work = min(self.work_seconds(request, w) for w in workers)
        held = Held(request, {w.url: w for w in workers}, future,  # type: ignore[arg-type]
                    min(request.uncached_tokens(w) for w in workers))
        arrival = self.now() if future is not None else 0.0
        return Waiting(request.request_id, request.prompt_tokens, work, arrival, held)

    def _pump(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self.queue.items:
            return
        now = self.now()
        instances = [self.clocks[url] for url in self.workers if url in self.clocks]
        self.queue.pump(now, instances, self._book)
        wake = self.queue.next_wakeup(now, instances)
        if wake is not None and self.queue.items:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_at(max(wake, now + 1e-4), self._pump)

    def _book(self, release: Release) -> None:
        held: Held = release.item.payload
        worker = held.allowed[release.instance.key]
        clock, uncached, now = self.clock(worker), held.request.uncached_tokens(worker), self.now()
        clock.on_sent(held.request.request_id, uncached, now)
        if self.delays is not None:
            self.delays.released(held.request.request_id, now,
                                 clock.model.predict([max(1, uncached)]))
        self.released[release.reason] = self.released.get(release.reason, 0) + 1
        if not held.future.done():
            held.future.set_result(Decision(worker, release.reason))
        else:  # the client left between the decision and now: nothing was sent
            clock.on_failed(held.request.request_id)
            if self.delays is not None:
                self.delays.forget(held.request.request_id)

    # ---- hooks ------------------------------------------------------------------------------
    def on_prefill_done(self, request: RouteRequest, worker: Worker, seconds: float) -> None:
        clock = self.clocks.get(worker.url)
        if clock is not None:
            clock.on_done(request.request_id, self.now())
        if self.delays is not None:
            self.delays.done(request.request_id, self.now())
        self._pump()

    def on_complete(self, request: RouteRequest, worker: Worker, ok: bool) -> None:
        if self.context.role is Role.DECODE:
            self._flush_decode()
            return
        clock = self.clocks.get(worker.url)
        if clock is not None and request.request_id in clock.sent:
            if ok:  # regular mode: no separate prefill event, the answer closes it
                clock.on_done(request.request_id, self.now())
                if self.delays is not None:
                    self.delays.done(request.request_id, self.now())
            else:
                clock.on_failed(request.request_id)
        if self.delays is not None:
            self.delays.forget(request.request_id)
        self._pump()

    def on_loads(self, worker: Worker) -> None:
        loads = worker.loads
        self.clock(worker).model.seed_per_token(loads.prefill_busy_us / 1e6,
                                                loads.prefill_uncached_tokens)

    def on_workers_changed(self, workers: Sequence[Worker]) -> None:
        keep = {w.url for w in workers}
        for url in [u for u in self.workers if u not in keep]:
            self.workers.pop(url, None)
            self.clocks.pop(url, None)

    # ---- decode: LPT ------------------------------------------------------------------------
    async def _schedule_decode(self, request: RouteRequest, workers: list[Worker]
                               ) -> Decision | None:
        future: asyncio.Future[Decision] = asyncio.get_running_loop().create_future()
        weight = request.prompt_tokens + self.decode_output_weight * request.output_tokens
        self._seq += 1
        entry = _DecodeWait(weight, self._seq, request, workers, future)
        self._decode_pending.append(entry)
        if self._decode_flush is None:
            self._decode_flush = asyncio.get_running_loop().call_soon(self._flush_decode)
        try:
            return await future
        except asyncio.CancelledError:
            if entry in self._decode_pending:
                self._decode_pending.remove(entry)
            raise

    def decode_cap(self, worker: Worker) -> int:
        return int(self.context.config.oas_decode_max_running
                   or worker.loads.max_running_reqs or 0)

    @staticmethod
    def decode_load(worker: Worker, rank: int | None = None) -> int:
        """Tokens of KV the worker (or one of its DP ranks) holds or will: the larger of ours
        and its own report."""
        if rank is None:
            return max(worker.inflight_tokens, worker.loads.used_tokens)
        return max(worker.rank_inflight_tokens[rank], worker.loads.rank(rank).used_tokens)

    def _flush_decode(self) -> None:
        """Longest first, each to the least-loaded place under its worker's cap; a place is a
        worker, or one DP rank of it under ``--dp-aware`` (LPT over every rank of the pool)."""
        self._decode_flush = None
        if not self._decode_pending:
            return
        key = (lambda e: (-e.weight, e.seq)) if self.lpt else (lambda e: e.seq)
        extra: dict[tuple[str, int | None], float] = {}
        running: dict[str, int] = {}
        still: list[_DecodeWait] = []
        for entry in sorted(self._decode_pending, key=key):
            if entry.future.done():
                continue
            places = [(w, r) for w in entry.workers
                      if not self.decode_cap(w) or w.inflight_requests + running.get(w.url, 0)
                      < self.decode_cap(w)
                      for r in (range(w.dp_size) if w.dp_size > 1 else (None,))]
            if not places:
                still.append(entry)
                continue
            best, rank = min(places, key=lambda p: (
                self.decode_load(*p) + extra.get((p[0].url, p[1]), 0.0),
                p[0].inflight_requests + running.get(p[0].url, 0), self.rng.random()))
            extra[(best.url, rank)] = extra.get((best.url, rank), 0.0) + entry.weight
            running[best.url] = running.get(best.url, 0) + 1
            entry.future.set_result(Decision(best, "lpt" if self.lpt else "least_load", rank))
        self._decode_pending = still

    def describe(self) -> dict[str, Any]:
        return {"queued": len(self.queue), "released": dict(self.released),
                "instances": {url: c.describe() for url, c in self.clocks.items()},
                "max_hold_s": (self.queue.max_hold(list(self.clocks.values()))
                               if self.clocks else math.nan)}
