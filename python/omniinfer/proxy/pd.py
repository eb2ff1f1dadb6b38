"""PD mode: each attempt sends one request through a prefill and a decode worker at once.

The same body plus bootstrap_host/port/room goes to both; the client gets the decode stream as
it comes. The prefill request runs as a task that holds the prefill booking until it ends (it
may end after the decode answer); a prefill that fails fails the attempt. A prefill booking
costs its uncached prompt tokens, a decode one the whole prompt plus the output budget. What
an attempt aborts, retries and gives back is the attempt loop's (``attempt.py``).

The PD phases after prefill_scheduled (``request.py``) come from the two workers' events, all
marked here but the first token a stream sends the client (``worker_http.pipe``): the prefill
worker's response head (prefill_running) and its completed answer, the prefill done
(decode_waiting); the decode worker's first output (decode_scheduled: a stream's first event, a
non-streamed answer's head) and, non-streamed, that answer read whole (decode_running). The
decode worker's stream head is no phase event: SGLang sends it at once, while the prefill runs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from omniinfer.proxy.accuracy import reported_cached_tokens
from omniinfer.proxy.attempt import Attempt, HeldTask, Strategy, decide_in_turn
from omniinfer.proxy.http1_response import Response
from omniinfer.proxy.policy_api import Decision, RouteRequest
from omniinfer.proxy.request import Phase, Request
from omniinfer.proxy.worker_http import (
    Passthrough,
    UpstreamFailure,
    count_output,
    first_chunk,
    pipe,
    post,
    read_all,
)
from omniinfer.proxy.workers import Role, Worker

if TYPE_CHECKING:
    from omniinfer.proxy.core import Router


class PD(Strategy):
    """Each attempt decides a prefill then a decode worker and posts the same body to both."""

    roles = (Role.PREFILL, Role.DECODE)

    def __init__(self, router: Router, client: web.Request, request: Request) -> None:
        super().__init__(router, client, request)
        self.decode_route = dataclasses.replace(request.route)  # matched on the decode index

    async def decide(self, candidates: dict[Role, list[Worker]]) -> list[Decision] | None:
        return await _decide(self.router, self.request, self.decode_route,
                             candidates[Role.PREFILL], candidates[Role.DECODE])

    def cost(self, decision: Decision) -> tuple[RouteRequest, int]:
        route = self.request.route
        if decision.worker.role is Role.PREFILL:
            return route, route.uncached_tokens(decision.worker)
        return self.decode_route, route.prompt_tokens + route.output_tokens

    def extra(self, decisions: list[Decision]) -> dict[str, Any]:
        extra = _bootstrap(decisions[0].worker, self.request.batch)
        self.request.bootstrap_room = extra["bootstrap_room"]
        return extra

    async def send(self, attempt: Attempt) -> web.StreamResponse:
        router, req = self.router, self.request
        p, d = attempt.bookings[0].worker, attempt.bookings[1].worker
        attempt.scheduled()
        prefill = router.spawn(self._prefill(attempt, p))
        attempt.hold(p, prefill)  # the prefill's booking lasts as long as its request
        decode = asyncio.ensure_future(self._decode_open(d, attempt.payload_for(d)))
        pending: set[asyncio.Future[Any]] = {decode, prefill}
        try:
            while not decode.done():
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if prefill in done:
                    _check_prefill(p, prefill, decode)
        except BaseException:
            decode.cancel()
            raise
        resp, first = decode.result()  # its UpstreamFailure/Passthrough: the loop aborts both
        if req.stream:
            return await pipe(router, self.client, req, resp, first, d,
                              on_upstream_error=lambda: prefill.done() or router.abort(
                                  p, attempt.rids, "decode_failed"))
        data = first
        if req.endpoint == "generate" and req.body.get("return_logprob"):
            data = await _merge_input_logprobs(prefill, data)
        req.life.enter(Phase.DECODE_RUNNING)  # the whole answer is here (no first token to see)
        d.breaker.record_success()
        count_output(req, data)
        return web.Response(body=data, headers=req.headers,
                            content_type=resp.content_type or "application/json")

    async def _prefill(self, attempt: Attempt, worker: Worker) -> tuple[int, bytes]:
        """The prefill request run to completion: (status, body); transport errors raise. Its
        response head enters prefill_running, its completed answer (prefill done) decode_waiting
        (ignored when the decode's first output came first: that implied both)."""
        try:
            resp = await post(self.router, worker, self.path, attempt.payload_for(worker),
                              stream=False, extra=self.request.trace_lines)
        except Passthrough as p:
            return p.response.status, bytes(p.response.body or b"")  # type: ignore[arg-type]
        life = self.request.life
        life.enter(Phase.PREFILL_RUNNING)
        data = await read_all(resp, worker)
        now = time.perf_counter()
        life.enter(Phase.DECODE_WAITING, now)
        worker.breaker.record_success()
        attempt.cache_reported(worker, reported_cached_tokens(data))
        attempt.prefill_done(worker, now)
        return 200, data

    async def _decode_open(self, d: Worker, payload: bytes) -> tuple[Response, bytes]:
        """Decode response headers then its first chunk (stream) or whole body (non-stream).

        The decode worker's first output enters decode_scheduled: a stream's first event (its
        head comes at once, before the prefill is done), a non-streamed answer's head (sent with
        the answer, once decoded)."""
        req = self.request
        resp = await post(self.router, d, self.path, payload, req.stream, req.trace_lines)
        if req.stream:
            first = await first_chunk(self.router, resp, d)
            req.life.enter(Phase.DECODE_SCHEDULED)
            return resp, first
        req.life.enter(Phase.DECODE_SCHEDULED)
        return resp, await read_all(resp, d)


async def _decide(router: Router, req: Request, decode_route: RouteRequest, prefills: list[Worker],
                  decodes: list[Worker]) -> list[Decision] | None:
    """Both decisions (prefill, decode), or None; a prefill decision without its decode is
    given back. The decode view is matched on the decode index once the prefill is decided."""
    def decode_view() -> RouteRequest:
        if router.policies[Role.DECODE].uses_prefix:
            decode_route.matched_blocks = router.indexes[Role.DECODE].match(req.route.block_hashes)
        return decode_route

    return await decide_in_turn(router, [(Role.PREFILL, lambda: req.route, prefills),
                                         (Role.DECODE, decode_view, decodes)])


def _bootstrap(p: Worker, batch: int) -> dict[str, Any]:
    room = [random.getrandbits(63) for _ in range(batch)]
    if batch == 1:
        return {"bootstrap_host": p.host, "bootstrap_port": p.bootstrap_port,
                "bootstrap_room": room[0]}
    return {"bootstrap_host": [p.host] * batch, "bootstrap_port": [p.bootstrap_port] * batch,
            "bootstrap_room": room}


def _check_prefill(p: Worker, prefill: HeldTask, decode: asyncio.Future[Any]) -> None:
    """A finished prefill that failed fails the attempt (the caller aborts its decode)."""
    exc = prefill.exception()
    if exc is None and prefill.result()[0] == 200:
        return
    decode.cancel()
    if exc is None:
        status, data = prefill.result()
        raise Passthrough(web.Response(status=status, body=data, content_type="application/json"),
                          p)
    if isinstance(exc, UpstreamFailure):
        raise UpstreamFailure(p, exc.kind, f"prefill failed: {exc}", exc.retryable,
                              f"prefill failed: {exc.summary}")
    raise UpstreamFailure(p, "prefill", f"prefill failed: {exc!r}")


async def _merge_input_logprobs(prefill: HeldTask, data: bytes) -> bytes:
    """return_logprob: the prompt's logprobs come from the prefill worker's answer."""
    try:
        status, pdata = await asyncio.wait_for(asyncio.shield(prefill), 30.0)
        if status != 200:
            return data
        pre, dec = orjson.loads(pdata), orjson.loads(data)
    except (asyncio.TimeoutError, UpstreamFailure, orjson.JSONDecodeError):
        return data
    pairs = zip(pre, dec, strict=False) if isinstance(pre, list) and isinstance(dec, list) \
        else [(pre, dec)]
    for a, b in pairs:
        if isinstance(a, dict) and isinstance(b, dict):
            am, bm = a.get("meta_info"), b.get("meta_info")
            if isinstance(am, dict) and isinstance(bm, dict) and "input_token_logprobs" in am:
                bm["input_token_logprobs"] = am["input_token_logprobs"]
    return orjson.dumps(dec)
