"""The attempt loop of one request, in both modes, and every side effect of its attempts.

``route`` admits the request, then tries up to ``--max-attempts`` times. One attempt: the
candidates of each role the strategy names (healthy, circuit closed, not yet failed for this
request), each role's policy deciding in turn on the strategy's view, the decisions (counted in
/metrics, written to the access log), fresh rids, one ``Booking`` per decided worker, then the
strategy's ``send``. A failure before any byte reached the client (``UpstreamFailure``) aborts
the failed worker and every partner still at work, before any retry; the next attempt waits the
backoff and leaves the failed worker out. A worker's refusal (``Passthrough``) goes to the client
and stops its partners; a client that goes away aborts every worker of the attempt. Regular and
PD mode differ only in their ``Strategy``, which crosses into this file only through its contract
(``strategy.py``): what it reports, ``Attempt.report`` turns into phase marks, breaker results,
policy hooks, cache checks and aborts (``_PHASE_OF``, ``_PREFILL_DONE``, ``_SUCCESS``).

Everything the router does to a worker's state for a request is done here: phase marks from
prefill_waiting on (``route``, ``Attempt.report``; tokenize and apc_matching are ``forward.py``'s),
breaker successes and failures, aborts, and these acquires, each with its release on every exit
path (answer, refusal, failure, exception, cancellation when the client leaves):
  admission slot    ``route`` acquires it and gives it back in its ``finally``
  policy decision   ``decide`` gives back (``on_cancelled``) the decisions of a set cut short
                    (a role without a decision, or the client left while one was awaited)
  booking           ``Booking()`` dispatches (load counters, prefix index, ``on_dispatch``);
                    ``_attempt``'s ``finally`` releases it (``on_complete``) unless a background
                    task holds it (``Attempt.background``): then that task's end releases it, and a
                    failed or left attempt cancels the task. A booking is released once.
A policy's own state beyond these hooks is its own: OAS books a prefill on its instance's clock
when its queue releases it (the queue's next release must see it) and gives it back on the hooks
called from here (``on_cancelled``, ``on_complete``, ``on_prefill_done``).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, Any

from aiohttp import web

from omniinfer.proxy.auth import error_response
from omniinfer.proxy.dp import assign_ranks, rank_fields
from omniinfer.proxy.policy_api import Decision, RouteRequest
from omniinfer.proxy.request import Phase, Request
from omniinfer.proxy.strategy import Event, HeldTask, Outbox, Strategy
from omniinfer.proxy.worker_http import Passthrough, UpstreamFailure
from omniinfer.proxy.workers import Role, Worker

if TYPE_CHECKING:
    from omniinfer.proxy.core import Router

log = logging.getLogger("omniinfer.proxy")
Chosen = list[tuple[RouteRequest, Decision]]  # each role's view and decision, in role order

# what each reported event does, by the reporting worker's role (``request.py``'s phase events)
_PHASE_OF: dict[tuple[Event, Role], Phase] = {
    (Event.POSTED, Role.REGULAR): Phase.PREFILL_SCHEDULED,
    (Event.POSTED, Role.PREFILL): Phase.PREFILL_SCHEDULED,
    (Event.HEAD, Role.REGULAR): Phase.PREFILL_RUNNING,
    (Event.HEAD, Role.PREFILL): Phase.PREFILL_RUNNING,
    (Event.ANSWER, Role.PREFILL): Phase.DECODE_WAITING,  # the prefill is done
    (Event.OUTPUT, Role.DECODE): Phase.DECODE_SCHEDULED,
    (Event.ANSWER, Role.DECODE): Phase.DECODE_RUNNING,  # non-streamed: no first token to see
}
# the worker finished the request's prefill: its policy learns how long it took
_PREFILL_DONE = {(Event.OUTPUT, Role.REGULAR), (Event.ANSWER, Role.PREFILL)}
_SUCCESS = {Event.ANSWER, Event.STREAM_END}  # the worker answered: its breaker's success


def count_failure(router: Router, worker: Worker, kind: str) -> None:
    """``worker`` failed an attempt with ``kind``. One that answered 401/403 (``auth``) did
    answer (a breaker success) but fails all the same: the router's key is wrong."""
    if kind == "auth":
        worker.breaker.record_success()
    router.record_failure(worker, kind)


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
        """The holding task ended: ok only if it answered 200; its upstream failure counts,
        and so does a refusal (the worker answered: a breaker success)."""
        exc = None if task.cancelled() else task.exception()
        if isinstance(exc, UpstreamFailure):
            count_failure(self.router, self.worker, exc.kind)
        ok = not task.cancelled() and exc is None and task.result()[0] == 200
        if not ok and not task.cancelled() and exc is None:
            self.worker.breaker.record_success()
        self.release(ok)


class Attempt(Outbox):
    """One try of a request: its bookings (in the strategy's role order), rids and the body
    each decided worker gets (the same but for its DP rank fields, ``dp.py``); the ``Outbox``
    its strategy sends through, whose ``report`` does what each event means."""

    __slots__ = ("router", "client", "request", "bookings", "rids", "payloads", "posted")

    def __init__(self, router: Router, client: web.Request, request: Request, rids: list[str],
                 payloads: dict[Worker, bytes]) -> None:
        self.router, self.client, self.request = router, client, request
        self.rids, self.payloads = rids, payloads
        self.bookings: list[Booking] = []  # made by the loop, one per decision
        self.posted = 0.0

    @property
    def workers(self) -> Sequence[Worker]:
        return [b.worker for b in self.bookings]

    def payload(self, worker: Worker) -> bytes:
        return self.payloads[worker]

    def booking(self, worker: Worker) -> Booking | None:
        for b in self.bookings:
            if b.worker is worker:
                return b
        return None

    def background(self, worker: Worker,
                   request: Coroutine[Any, Any, tuple[int, bytes]]) -> HeldTask:
        task = self.router.spawn(request)
        booking = self.booking(worker)
        assert booking is not None and booking.task is None
        booking.task = task
        task.add_done_callback(booking.task_done)
        return task

    def cancel_held(self) -> None:
        for b in self.bookings:
            if b.task is not None:
                b.task.cancel()

    def report(self, event: Event, worker: Worker, detail: Any = None) -> None:
        now = time.perf_counter()
        req, key = self.request, (event, worker.role)
        if event is Event.POSTED:
            self.posted = now  # prefill_scheduled starts (the prefill's time counts from here)
        phase = _PHASE_OF.get(key)
        if phase is not None:
            req.life.enter(phase, now)
        if event in _SUCCESS:
            worker.breaker.record_success()
        if key in _PREFILL_DONE:
            booking = self.booking(worker)
            view = req.route if booking is None else booking.view
            self.router.policies[worker.role].on_prefill_done(view, worker, now - self.posted)
        elif event is Event.CACHED:
            self._cache_reported(worker, detail)
        elif event is Event.FIRST_TOKEN:
            req.life.token(now)
        elif event is Event.STREAM_FAILED:
            kind, what = detail
            self.router.record_failure(worker, kind)
            req.error = f"{worker.url} failed mid-stream: {what}"
            self.stop(worker, kind)
        elif event is Event.STREAM_CUT:
            req.error = "cut by the router's shutdown"
            self.stop(worker, "shutdown")

    def held(self, worker: Worker) -> bool:
        """``worker``'s booking is held by a task (whose end counts its breaker result)."""
        booking = self.booking(worker)
        return booking is not None and booking.task is not None

    def stop(self, worker: Worker, cause: str) -> None:
        """Abort ``worker`` (``cause``) and its partners still at work (``<role>_failed``)."""
        self.router.abort(worker, self.rids, cause)
        self.stop_partners(worker, f"{worker.role.value}_failed")

    def stop_partners(self, worker: Worker, cause: str) -> None:
        """Abort the attempt's workers other than ``worker`` that are still at work."""
        for b in self.bookings:
            if b.worker is not worker and b.working:
                self.router.abort(b.worker, self.rids, cause)

    def _cache_reported(self, worker: Worker, reported: int | None) -> None:
        """Predicted vs reported cached tokens of the worker that served a single prompt."""
        req = self.request
        if req.batch != 1:
            return  # the prediction is for the first prompt of a batch only
        metrics = self.router.metrics
        req.predicted(reported, metrics.observe_prediction(
            self.router.cache_truth.label(worker), req.route.cached_tokens(worker), reported,
            req.route.block_size))


async def decide(router: Router, strategy: Strategy,
                 candidates: dict[Role, list[Worker]]) -> Chosen | None:
    """Each role's policy decides in turn (``schedule`` on the strategy's view of that role,
    asked when its turn comes, and that role's candidates); None if one has no decision.
    Decisions of a set cut short, by a missing decision or by cancellation, are given back to
    their policies (``on_cancelled``)."""
    chosen: Chosen = []
    complete = False
    try:
        for role in strategy.roles:
            view = strategy.view(role)
            decision = await router.policies[role].schedule(view, candidates[role])
            if decision is None:
                return None
            chosen.append((view, decision))
        complete = True
        return chosen
    finally:
        if not complete:
            for role, (view, decision) in zip(strategy.roles, chosen, strict=False):
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
        chosen = await decide(router, strategy, candidates)
        if chosen is None:
            break
        decisions = [decision for _, decision in chosen]
        assign_ranks(decisions)
        for decision in decisions:
            _decided(router, req, decision, number)
        fields = strategy.fields([d.worker for d in decisions])
        rids = router.new_rids(req.batch)
        req.attempted(rids, fields)
        bodies = req.payloads(rids, fields, rank_fields(decisions))
        attempt = Attempt(router, strategy.client, req, rids,
                          {d.worker: body for d, body in zip(decisions, bodies, strict=True)})
        outcome = await _attempt(router, strategy, attempt, chosen)
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
                   chosen: Chosen) -> web.StreamResponse | UpstreamFailure:
    """Book the decided workers and send; the answer, or the failure that ended the attempt
    (its workers aborted). Whatever ends it, each booking made here is released (a held one
    when its task ends, which also counts its worker's breaker result)."""
    req, rids, ok = attempt.request, attempt.rids, False
    try:
        for view, decision in chosen:
            attempt.bookings.append(Booking(router, view, decision.worker,
                                            strategy.cost(decision.worker), decision.rank))
        out = await strategy.send(attempt)
        ok = True
        return out
    except Passthrough as refused:  # a worker refused the request: its partners stop too
        ok = True
        if not attempt.held(refused.worker):
            refused.worker.breaker.record_success()  # it answered
        attempt.stop_partners(refused.worker, "refused")
        return refused.response
    except UpstreamFailure as f:
        if not attempt.held(f.worker):
            count_failure(router, f.worker, f.kind)
        req.failed(f.worker.url, f)
        # before any retry: the worker that failed, and its partners, stop this attempt
        attempt.stop(f.worker, f.kind)
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
