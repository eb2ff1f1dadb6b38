"""The attempt loop of one request, in both modes, and every booking it takes and gives back.

``route`` admits the request, then tries up to ``--max-attempts`` times. One attempt: the
candidates of each role the strategy names (healthy, circuit closed, not yet failed for this
request), the strategy's decisions (counted in /metrics, written to the access log), fresh rids,
one ``Booking`` per decided worker, then the strategy's ``send``. A failure before any byte
reached the client (``UpstreamFailure``) aborts the failed worker and every partner still at
work, before any retry; the next attempt waits the backoff and leaves the failed worker out. A
worker's refusal (``Passthrough``) goes to the client and stops its partners; a client that goes
away aborts every worker of the attempt. Regular and PD mode differ only in their ``Strategy``.

Each acquire here has its release on every exit path (answer, refusal, failure, exception,
cancellation when the client leaves):
  admission slot    ``route`` acquires it and gives it back in its ``finally``
  policy decision   ``decide_in_turn`` gives back (``on_cancelled``) the decisions of a set cut short
                    (a role without a decision, or the client left while one was awaited)
  booking           ``Booking()`` dispatches (load counters, prefix index, ``on_dispatch``);
                    ``_attempt``'s ``finally`` releases it (``on_complete``) unless a background
                    task holds it (``Attempt.hold``): then that task's end releases it, and a
                    failed or left attempt cancels the task. A booking is released once.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import random
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from aiohttp import web

from omniinfer.proxy.auth import error_response
from omniinfer.proxy.dp import assign_ranks, rank_fields
from omniinfer.proxy.policy_api import Decision, RouteRequest
from omniinfer.proxy.request import PD_PHASES, Phase, Request
from omniinfer.proxy.worker_http import UPSTREAM_PATHS, Passthrough, UpstreamFailure
from omniinfer.proxy.workers import Role, Worker

if TYPE_CHECKING:
    from omniinfer.proxy.core import Router

log = logging.getLogger("omniinfer.proxy")
HeldTask = asyncio.Task[tuple[int, bytes]]  # a worker's whole answer: (status, body)
Choice = tuple[Role, Callable[[], RouteRequest], list[Worker]]  # role, its view, its workers


class Booking:
    """One decided worker's share of an attempt: ``cost`` tokens of load, the request's blocks
    in the worker's prefix index (or expected from its KV events) and its policy's booking.
    Made by dispatching; ``release`` gives back the load and the policy's booking, once."""

    __slots__ = ("router", "view", "worker", "rank", "cost", "task", "released")

    def __init__(self, router: Router, view: RouteRequest, worker: Worker, cost: int,
                 rank: int | None = None) -> None:
        self.router, self.view, self.worker, self.cost = router, view, worker, cost
        self.rank = rank  # the worker's DP rank that serves it (``--dp-aware``), else None
        self.task: HeldTask | None = None
        self.released = False
        worker.inflight_requests += 1
        worker.inflight_tokens += cost
        worker.total_requests += 1
        if rank is not None:
            worker.book_rank(rank, cost)
        if not router.cache_truth.follows(worker):  # else the worker's KV events fill its index
            router.indexes[worker.role].insert(worker.url, view.block_hashes)
        else:  # and what was just sent counts until those events report its prefill
            router.cache_truth.expect(worker, view.block_hashes)
        policy = router.policies[worker.role]
        policy.context.observe_request_tokens(cost)
        policy.on_dispatch(view, worker)

    @property
    def working(self) -> bool:
        """The worker may still be running this attempt (a held one: until its task ends)."""
        return not self.released and (self.task is None or not self.task.done())

    def release(self, ok: bool) -> None:
        if self.released:
            return
        self.released = True
        self.worker.inflight_requests -= 1
        self.worker.inflight_tokens -= self.cost
        if self.rank is not None:
            self.worker.release_rank(self.rank, self.cost)
        self.router.policies[self.worker.role].on_complete(self.view, self.worker, ok)

    def task_done(self, task: HeldTask) -> None:
        """The holding task ended: ok only if it answered 200; its upstream failure counts."""
        exc = None if task.cancelled() else task.exception()
        if isinstance(exc, UpstreamFailure):
            self.router.record_failure(self.worker, exc.kind)
        self.release(not task.cancelled() and exc is None and task.result()[0] == 200)


class Attempt:
    """One try of a request: its bookings (in the strategy's role order), rids and the body
    each decided worker gets (the same but for its DP rank fields, ``dp.py``)."""

    __slots__ = ("router", "request", "bookings", "rids", "payloads", "posted")

    def __init__(self, router: Router, request: Request, rids: list[str],
                 payloads: dict[Worker, bytes]) -> None:
        self.router, self.request, self.rids, self.payloads = router, request, rids, payloads
        self.bookings: list[Booking] = []  # made by the loop, one per decision
        self.posted = 0.0

    def payload_for(self, worker: Worker) -> bytes:
        return self.payloads[worker]

    def booking(self, worker: Worker) -> Booking | None:
        for b in self.bookings:
            if b.worker is worker:
                return b
        return None

    def hold(self, worker: Worker, task: HeldTask) -> None:
        """``worker``'s booking lasts until ``task`` ends, even past the attempt's answer."""
        booking = self.booking(worker)
        assert booking is not None and booking.task is None
        booking.task = task
        task.add_done_callback(booking.task_done)

    def cancel_held(self) -> None:
        for b in self.bookings:
            if b.task is not None:
                b.task.cancel()

    def scheduled(self) -> None:
        """The first post goes out now: prefill_scheduled starts (``prefill_done`` times it)."""
        self.posted = time.perf_counter()
        self.request.life.enter(Phase.PREFILL_SCHEDULED, self.posted)

    def prefill_done(self, worker: Worker, now: float | None = None) -> None:
        """``worker`` finished this request's prefill: its policy learns how long it took."""
        seconds = (time.perf_counter() if now is None else now) - self.posted
        booking = self.booking(worker)
        view = self.request.route if booking is None else booking.view
        self.router.policies[worker.role].on_prefill_done(view, worker, seconds)

    def cache_reported(self, worker: Worker, reported: int | None) -> None:
        """Predicted vs reported cached tokens of the worker that served a single prompt."""
        req = self.request
        if req.batch != 1:
            return  # the prediction is for the first prompt of a batch only
        metrics = self.router.metrics
        req.predicted(reported, metrics.observe_prediction(
            self.router.cache_truth.label(worker), req.route.cached_tokens(worker), reported,
            req.route.block_size))


class Strategy(abc.ABC):
    """What one mode does in an attempt; one instance per request.

    ``roles``: the roles decided per attempt, in order (a booking per role, same order).
    ``phases``: the lifecycle phases of the mode (``request.py``), set on the request's clock.
    ``decide`` returns one decision per role, each worker among that role's candidates (all
    non-empty), or None; it uses ``decide_in_turn`` so that a set cut short is given back.
    ``cost``: the policy view and the tokens booked on a decided worker. ``extra``: fields added
    to the workers' body. ``send`` posts the attempt and answers the client; it raises
    ``UpstreamFailure`` (nothing reached the client) or ``Passthrough`` (a worker refused).
    """

    roles: tuple[Role, ...] = ()
    phases: tuple[Phase, ...] = PD_PHASES

    def __init__(self, router: Router, client: web.Request, request: Request) -> None:
        self.router, self.client, self.request = router, client, request
        request.life.phases = self.phases
        self.path = UPSTREAM_PATHS[request.endpoint]

    @abc.abstractmethod
    async def decide(self, candidates: dict[Role, list[Worker]]) -> list[Decision] | None: ...

    @abc.abstractmethod
    def cost(self, decision: Decision) -> tuple[RouteRequest, int]: ...

    def extra(self, decisions: list[Decision]) -> dict[str, Any] | None:
        return None

    @abc.abstractmethod
    async def send(self, attempt: Attempt) -> web.StreamResponse: ...


async def decide_in_turn(router: Router, choices: Sequence[Choice]) -> list[Decision] | None:
    """Each role's policy decides in turn (``schedule`` on the view, made when its turn comes,
    and that role's workers); None if one has no decision. Decisions of a set cut short, by a
    missing decision or by cancellation, are given back to their policies (``on_cancelled``)."""
    decisions: list[Decision] = []
    views: list[RouteRequest] = []
    complete = False
    try:
        for role, view_of, workers in choices:
            view = view_of()
            decision = await router.policies[role].schedule(view, workers)
            if decision is None:
                return None
            decisions.append(decision)
            views.append(view)
        complete = True
        return decisions
    finally:
        if not complete:
            for (role, _, _), view, decision in zip(choices, views, decisions, strict=False):
                router.policies[role].on_cancelled(view, decision.worker)


async def route(router: Router, strategy: Strategy) -> web.StreamResponse:
    """The request admitted (a token of the rate limit and a slot, or ``Rejected``), then its
    attempts."""
    strategy.request.life.enter(Phase.PREFILL_WAITING)
    if router.rate_limit is not None:
        await router.rate_limit.take()
    await router.admission.acquire()
    try:
        return await _attempts(router, strategy)
    finally:
        router.admission.release()


async def _attempts(router: Router, strategy: Strategy) -> web.StreamResponse:
    c, req = router.config, strategy.request
    tried: dict[Role, list[Worker]] = {role: [] for role in strategy.roles}
    failure: UpstreamFailure | None = None
    for number in range(c.max_attempts):
        now = time.monotonic()
        candidates = {role: router.pool.candidates(role, now, tried[role])
                      for role in strategy.roles}
        if not all(candidates.values()):
            break
        decisions = await strategy.decide(candidates)
        if decisions is None:
            break
        assign_ranks(decisions)
        for decision in decisions:
            _decided(router, req, decision, number)
        extra = strategy.extra(decisions)
        rids = router.new_rids(req.batch)
        bodies = req.payloads(rids, extra, rank_fields(decisions))
        attempt = Attempt(router, req, rids,
                          {d.worker: body for d, body in zip(decisions, bodies, strict=True)})
        outcome = await _attempt(router, strategy, attempt, decisions)
        if not isinstance(outcome, UpstreamFailure):
            return outcome
        failure = outcome
        tried[failure.worker.role].append(failure.worker)
        if not failure.retryable:
            break
        if number + 1 < c.max_attempts:
            router.metrics.retries.labels(failure.worker.role.value, failure.kind).inc()
            await backoff(router, number)
    return no_worker(failure)


async def _attempt(router: Router, strategy: Strategy, attempt: Attempt,
                   decisions: list[Decision]) -> web.StreamResponse | UpstreamFailure:
    """Book the decided workers and send; the answer, or the failure that ended the attempt
    (its workers aborted). Whatever ends it, each booking made here is released (a held one
    when its task ends)."""
    req, rids, ok = attempt.request, attempt.rids, False
    try:
        for decision in decisions:
            view, cost = strategy.cost(decision)
            attempt.bookings.append(Booking(router, view, decision.worker, cost, decision.rank))
        out = await strategy.send(attempt)
        ok = True
        return out
    except Passthrough as refused:  # a worker refused the request: its partners stop too
        ok = True
        for b in attempt.bookings:
            if b.worker is not refused.worker and b.working:
                router.abort(b.worker, rids, "refused")
        return refused.response
    except UpstreamFailure as f:
        failed = attempt.booking(f.worker)
        if failed is None or failed.task is None:  # a held one counts when its task ends
            router.record_failure(f.worker, f.kind)
        req.failed(f.worker.url, f)
        # before any retry: the worker that failed, and its partners, stop this attempt
        router.abort(f.worker, rids, f.kind)
        for b in attempt.bookings:
            if b.worker is not f.worker and b.working:
                router.abort(b.worker, rids, f"{f.worker.role.value}_failed")
        attempt.cancel_held()
        return f
    except (asyncio.CancelledError, ConnectionResetError):
        attempt.cancel_held()
        if req.delivered:  # gone after its last event: answered, nothing left to abort
            ok = True
            raise
        cut = router.drain.is_cut()
        cause = "shutdown" if cut else "client_disconnected"
        req.error = "cut by the router's shutdown" if cut else "client disconnected"
        for b in attempt.bookings:
            router.abort(b.worker, rids, cause)
        raise
    finally:
        for b in attempt.bookings:
            if b.task is None:
                b.release(ok)


def _decided(router: Router, req: Request, decision: Decision, attempt: int) -> None:
    role = decision.worker.role
    policy = router.policies[role]
    router.metrics.decision(policy.name, role.value, decision.reason)
    req.decided(role.value, decision.worker.url, decision.reason, policy.name, attempt,
                req.route.cached_tokens(decision.worker), decision.rank)


async def backoff(router: Router, attempt: int) -> None:
    c = router.config
    delay = min(c.retry_max_backoff_ms, c.retry_initial_backoff_ms
                * c.retry_backoff_multiplier ** attempt) / 1000.0
    delay *= 1.0 + c.retry_jitter_factor * (2 * random.random() - 1)
    await asyncio.sleep(max(0.0, delay))


def no_worker(failure: UpstreamFailure | None) -> web.Response:
    """The answer when no attempt succeeded; the worker's URL and text stay in the log."""
    if failure is None:
        return error_response(503, "no healthy worker available", "unavailable", retry_after=1)
    log.warning("request failed: %s: %s", failure.worker.url, failure)
    return error_response(502, f"the upstream worker failed ({failure.summary})",
                          "upstream_error")
