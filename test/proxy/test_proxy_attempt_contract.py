"""The strategy contract (``proxy/strategy.py``): both modes through one fake upstream.

``FakeUpstream`` plays SGLang's workers of either mode (a regular worker; a PD prefill and decode
pair that hands the KV over through the bootstrap room). The same requests go through a regular
router and a PD router in front of it, while the test watches the contract's crossings and
their effects:

- every event a strategy reports (``Attempt.report``), in order, with the phase it left the
  request in;
- every phase the request's clock entered by an event of its own (``Lifecycle.enter``): a PD
  request enters all eight of ``PD_PHASES`` in order, a regular one the six of its mode;
- every booking (the policies' ``on_dispatch`` / ``on_complete`` / ``on_prefill_done``): each
  decided worker is dispatched once and completed once, ok, its load counters back at zero, and
  OAS's clocks keep nothing once the prefill is done;
- the breaker and the aborts: a worker that fails before the answer is counted once, aborted,
  and its partner too.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from router_inproc import ScriptedWorker

from omniinfer.child_process import free_port
from omniinfer.proxy.attempt import Attempt
from omniinfer.proxy.config import RouterConfig
from omniinfer.proxy.request import PD_PHASES, REGULAR_PHASES, Lifecycle, Phase
from omniinfer.proxy.server import Serving, open_router
from omniinfer.proxy.strategy import Event
from omniinfer.proxy.workers import Role

STEP_S = 0.15  # the fake's compute: a prefill, then the decode's first event after the KV
TOKENS = 3


def _sse(data: Any) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"


def _answer(tokens: int) -> dict[str, Any]:
    return {"text": "x" * tokens, "meta_info": {"completion_tokens": tokens, "prompt_tokens": 4,
                                                "cached_tokens": 0}}


class FakeUpstream:
    """SGLang's workers of both modes, in process: ``worker(role)`` starts one.

    A regular worker computes ``STEP_S``, then answers (a stream: its head at once, then
    ``TOKENS`` events). A prefill worker computes ``STEP_S``, hands the KV over (sets the
    bootstrap room) and answers. A decode worker sends a stream's head at once, waits for the
    room, then ``STEP_S`` later its first event (a non-streamed answer then, whole); a room
    never handed over ends it after a second. ``fail[role]``: that many of the next requests
    to a worker of ``role`` are answered 503."""

    def __init__(self) -> None:
        self.rooms: dict[int, asyncio.Event] = {}
        self.workers: dict[str, ScriptedWorker] = {}
        self.fail: dict[Role, int] = {}

    async def worker(self, role: Role) -> str:
        async def generate(request: web.Request) -> web.StreamResponse:
            return await self._generate(role, await request.json(), request)

        scripted = ScriptedWorker({"/generate": generate})
        url = await scripted.start()
        self.workers[url] = scripted
        return url

    async def _generate(self, role: Role, body: dict[str, Any],
                        request: web.Request) -> web.StreamResponse:
        if self.fail.get(role, 0) > 0:
            self.fail[role] -= 1
            return web.json_response({"error": "overloaded"}, status=503)
        room = None
        if role is not Role.REGULAR:
            room = self.rooms.setdefault(int(body["bootstrap_room"]), asyncio.Event())
        if role is Role.PREFILL:
            await asyncio.sleep(STEP_S)
            room.set()  # type: ignore[union-attr]
            return web.json_response(_answer(1))
        out = None
        if body.get("stream"):
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
        if room is not None:
            try:
                await asyncio.wait_for(room.wait(), 1.0)
            except TimeoutError:  # its prefill failed: this decode was given up
                return out or web.json_response({"error": "no KV"}, status=500)
        await asyncio.sleep(STEP_S)
        if out is None:
            return web.json_response(_answer(TOKENS))
        for i in range(1, TOKENS + 1):
            await out.write(_sse(_answer(i)))
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    def aborts(self) -> list[str]:
        return [url for url, w in self.workers.items() for p in w.paths() if p == "/abort_request"]

    async def close(self) -> None:
        for w in self.workers.values():
            await w.close()


class Watch:
    """What crosses the contract and what it does, recorded per request id."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[tuple[Event, Role, Phase]] = []
        self.entered: dict[str, list[Phase]] = {}
        self.hooks: list[tuple[str, Role, str, Any]] = []
        # on_dispatch: the request object each role's policy saw, and its matches then
        self.views: list[tuple[Role, Any, dict[str, int]]] = []
        report, enter = Attempt.report, Lifecycle.enter

        def spy_report(attempt: Attempt, event: Event, worker: Any, detail: Any = None) -> None:
            report(attempt, event, worker, detail)
            self.events.append((event, worker.role, Phase(attempt.request.life.last)))

        def spy_enter(life: Lifecycle, phase: Phase, now: float | None = None) -> bool:
            entered = enter(life, phase, now)
            if entered:
                self.entered.setdefault(life.request_id, []).append(phase)
            return entered

        monkeypatch.setattr(Attempt, "report", spy_report)
        monkeypatch.setattr(Lifecycle, "enter", spy_enter)

    def policies(self, serving: Serving) -> None:
        """Record every booking hook the router calls on its policies."""
        for role, policy in serving.router.policies.items():
            for hook in ("on_dispatch", "on_complete", "on_prefill_done", "on_cancelled"):
                setattr(policy, hook, self._spy(role, hook, getattr(policy, hook)))

    def _spy(self, role: Role, hook: str, inner: Any) -> Any:
        def spy(request: Any, worker: Any, *rest: Any) -> None:
            self.hooks.append((hook, role, worker.url, rest[0] if rest else None))
            if hook == "on_dispatch":
                self.views.append((role, request, dict(request.matched_blocks)))
            inner(request, worker, *rest)
        return spy


@pytest.fixture
def watch(monkeypatch: pytest.MonkeyPatch) -> Iterator[Watch]:
    yield Watch(monkeypatch)


async def _router(upstream: FakeUpstream, pd: bool, policy: str, per_role: int = 1
                  ) -> Serving:
    settings: dict[str, Any] = {"host": "127.0.0.1", "port": free_port(), "policy": policy,
                                "loads_poll_interval_secs": 0, "disable_health_check": True,
                                "retry_initial_backoff_ms": 1}
    if pd:
        settings["pd_disaggregation"] = True
        settings["prefill_urls"] = [(await upstream.worker(Role.PREFILL), free_port())
                                    for _ in range(per_role)]
        settings["decode_urls"] = [await upstream.worker(Role.DECODE) for _ in range(per_role)]
    else:
        settings["worker_urls"] = [await upstream.worker(Role.REGULAR) for _ in range(per_role)]
    return await open_router(RouterConfig(**settings))


async def _send(serving: Serving, stream: bool, text: str = "the contract") -> tuple[int, bytes]:
    base = f"http://127.0.0.1:{serving.router.config.port}"
    body = {"text": text, "sampling_params": {"max_new_tokens": TOKENS},
            "stream": stream}
    async with aiohttp.ClientSession() as session:
        async with session.post(base + "/generate", json=body) as r:
            return r.status, await r.read()


async def _settled(serving: Serving) -> None:
    """Until every booking and the admission slot are given back (a PD prefill's booking may
    end after the answer, the slot after the client read its last byte)."""
    router, deadline = serving.router, time.monotonic() + 10
    while router.admission.active or any(w.inflight_requests for w in router.pool.all()):
        assert time.monotonic() < deadline, "a booking was never given back"
        await asyncio.sleep(0.01)


PD_STREAM = [(Event.POSTED, Role.PREFILL, Phase.PREFILL_SCHEDULED),
             (Event.HEAD, Role.PREFILL, Phase.PREFILL_RUNNING),
             (Event.ANSWER, Role.PREFILL, Phase.DECODE_WAITING),
             (Event.CACHED, Role.PREFILL, Phase.DECODE_WAITING),
             (Event.OUTPUT, Role.DECODE, Phase.DECODE_SCHEDULED)]
EXPECTED_EVENTS = {
    (True, True): PD_STREAM + [(Event.FIRST_TOKEN, Role.DECODE, Phase.DECODE_RUNNING),
                               (Event.STREAM_END, Role.DECODE, Phase.DECODE_RUNNING)],
    (True, False): PD_STREAM + [(Event.ANSWER, Role.DECODE, Phase.DECODE_RUNNING)],
    (False, True): [(Event.POSTED, Role.REGULAR, Phase.PREFILL_SCHEDULED),
                    (Event.HEAD, Role.REGULAR, Phase.PREFILL_RUNNING),
                    (Event.OUTPUT, Role.REGULAR, Phase.PREFILL_RUNNING),
                    (Event.FIRST_TOKEN, Role.REGULAR, Phase.DECODE_RUNNING),
                    (Event.STREAM_END, Role.REGULAR, Phase.DECODE_RUNNING),
                    (Event.CACHED, Role.REGULAR, Phase.DECODE_RUNNING)],
    (False, False): [(Event.POSTED, Role.REGULAR, Phase.PREFILL_SCHEDULED),
                     (Event.HEAD, Role.REGULAR, Phase.PREFILL_RUNNING),
                     (Event.ANSWER, Role.REGULAR, Phase.PREFILL_RUNNING),
                     (Event.CACHED, Role.REGULAR, Phase.PREFILL_RUNNING)],
}


@pytest.mark.parametrize("policy", ["cache_aware", "oas"])
@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("pd", [True, False], ids=["pd", "regular"])
def test_both_strategies_report_the_same_contract_and_book_alike(
        watch: Watch, pd: bool, stream: bool, policy: str) -> None:
    async def main() -> None:
        upstream = FakeUpstream()
        serving = await _router(upstream, pd, policy)
        watch.policies(serving)
        try:
            status, answer = await _send(serving, stream)
            assert status == 200, answer
            await _settled(serving)
            router = serving.router
            workers = router.pool.all()
            assert all(w.inflight_tokens == 0 and w.breaker.failures == 0 for w in workers)
            assert router.admission.active == 0
            for policy_ in router.policies.values():  # OAS: no clock keeps the request
                assert not any(c.sent for c in getattr(policy_, "clocks", {}).values())
        finally:
            await serving.close()
            await upstream.close()
        assert upstream.aborts() == []

        assert watch.events == EXPECTED_EVENTS[(pd, stream)]
        [entered] = watch.entered.values()
        mode = PD_PHASES if pd else REGULAR_PHASES
        shown = [p for p in mode if stream or pd or p is not Phase.DECODE_RUNNING]
        assert entered == shown  # each phase by an event of its own, in order

        roles = (Role.PREFILL, Role.DECODE) if pd else (Role.REGULAR,)
        for role in roles:  # each decided worker: dispatched once, completed once, ok
            hooks = [(hook, ok) for hook, r, _, ok in watch.hooks
                     if r is role and hook != "on_prefill_done"]
            assert hooks == [("on_dispatch", None), ("on_complete", True)], watch.hooks
        prefill_done = [r for hook, r, _, _ in watch.hooks if hook == "on_prefill_done"]
        assert prefill_done == ([Role.PREFILL] if pd else [Role.REGULAR] if stream else [])
        assert len({id(view) for _, view, _ in watch.views}) == 1  # one view, both roles

    asyncio.run(asyncio.wait_for(main(), 60))


def test_the_decode_policy_sees_the_decode_index_in_the_requests_one_view(watch: Watch) -> None:
    """PD with a prefix policy on both roles: the same prompt twice. The second time both
    policies get the request's one view, which the decode's turn completed: the decode
    index's match (its worker holds the prompt since the first request) beside the prefill
    index's."""
    async def main() -> None:
        upstream = FakeUpstream()
        serving = await _router(upstream, True, "cache_aware")
        watch.policies(serving)
        try:
            for _ in range(2):  # a prompt of many blocks
                status, answer = await _send(serving, False, "the contract, " * 200)
                assert status == 200, answer
                await _settled(serving)
            prefill, decode = (serving.router.pool.role(role)[0]
                               for role in (Role.PREFILL, Role.DECODE))
        finally:
            await serving.close()
            await upstream.close()
        # the first request matched nothing; the second, both roles' workers (dispatched after
        # both decisions: each booking sees the view the decode's turn completed)
        assert all(not seen for _, _, seen in watch.views[:2])
        (_, p_view, p_seen), (_, d_view, d_seen) = watch.views[2:]
        assert p_view is d_view and p_seen == d_seen
        assert d_seen[prefill.url] > 0 and d_seen[decode.url] > 0

    asyncio.run(asyncio.wait_for(main(), 60))


@pytest.mark.parametrize("pd", [True, False], ids=["pd", "regular"])
def test_a_failed_attempt_is_counted_aborted_and_given_back_alike(watch: Watch,
                                                                  pd: bool) -> None:
    """The first decided worker of the (prefill) role answers 503: it is counted once on its
    breaker, aborted with its partners, its booking given back not ok; the retry succeeds."""
    async def main() -> None:
        upstream = FakeUpstream()
        serving = await _router(upstream, pd, "round_robin", per_role=2)
        watch.policies(serving)
        first = Role.PREFILL if pd else Role.REGULAR
        upstream.fail[first] = 1
        try:
            status, answer = await _send(serving, True)
            assert status == 200, answer
            await _settled(serving)
            failures = sorted(w.breaker.failures for w in serving.router.pool.all())
            await asyncio.sleep(0.1)  # the fire-and-forget aborts have landed
        finally:
            await serving.close()
            await upstream.close()
        assert failures == [0] * (len(failures) - 1) + [1]
        completes = [(r, ok) for hook, r, _, ok in watch.hooks if hook == "on_complete"]
        expected = [(first, False), (first, True)]
        if pd:  # the decode of the failed attempt was stopped too
            assert sorted(completes, key=str) == sorted(
                expected + [(Role.DECODE, False), (Role.DECODE, True)], key=str), watch.hooks
            assert len(upstream.aborts()) == 2  # the failed prefill and its decode partner
        else:
            assert completes == expected
            assert len(upstream.aborts()) == 1
        [entered] = watch.entered.values()
        assert entered == list(PD_PHASES if pd else REGULAR_PHASES)

    asyncio.run(asyncio.wait_for(main(), 60))
