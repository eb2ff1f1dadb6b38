"""PD orchestration: one request through a prefill and a decode worker at once.

The same body plus bootstrap_host/port/room goes to both; the client gets the decode stream as
it comes. A failed prefill aborts its decode, a failed decode aborts its prefill, a client that
goes away aborts both; every attempt's bookings (load counters, the prefill policy's booking)
are released whatever ends it, including a decode decision that never comes.
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
from omniinfer.proxy.attempts import backoff, decided, no_worker, note_prediction
from omniinfer.proxy.base import Decision
from omniinfer.proxy.http1_response import Response
from omniinfer.proxy.lifecycle import Phase
from omniinfer.proxy.upstream import (
    UPSTREAM_PATHS,
    Exchange,
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

PrefillTask = asyncio.Task[tuple[int, bytes]]


async def _prefill(router: Router, ex: Exchange, worker: Worker, path: str, payload: bytes,
                   posted: float) -> tuple[int, bytes]:
    """Run the prefill request to completion; (status, body); transport errors raise."""
    try:
        resp = await post(router, worker, path, payload, stream=False)
    except Passthrough as p:
        return p.response.status, bytes(p.response.body or b"")  # type: ignore[arg-type]
    ex.life.enter(Phase.PREFILL_RUNNING)
    data = await read_all(resp, worker)
    now = time.perf_counter()
    ex.life.enter(Phase.DECODE_WAITING, now)
    worker.breaker.record_success()
    note_prediction(router, ex, worker, reported_cached_tokens(data))
    router.policies[Role.PREFILL].on_prefill_done(ex.route, worker, now - posted)
    return 200, data


def _release_prefill(router: Router, ex: Exchange, worker: Worker, cost: int,
                     task: PrefillTask) -> None:
    ok = not task.cancelled() and task.exception() is None and task.result()[0] == 200
    if not task.cancelled() and isinstance(task.exception(), UpstreamFailure):
        router.record_failure(worker, task.exception().kind)  # type: ignore[union-attr]
    router.undispatch(ex.route, worker, cost, ok)


def _bootstrap(p: Worker, batch: int) -> dict[str, Any]:
    room = [random.getrandbits(63) for _ in range(batch)]
    if batch == 1:
        return {"bootstrap_host": p.host, "bootstrap_port": p.bootstrap_port,
                "bootstrap_room": room[0]}
    return {"bootstrap_host": [p.host] * batch, "bootstrap_port": [p.bootstrap_port] * batch,
            "bootstrap_room": room}


async def _decide(router: Router, ex: Exchange, decode_route: Any, prefills: list[Worker],
                  decodes: list[Worker]) -> tuple[Decision, Decision] | None:
    """Both decisions, or None; a prefill booking without its decode is given back."""
    p_decision = await router.policies[Role.PREFILL].schedule(ex.route, prefills)
    if p_decision is None:
        return None
    decode_policy = router.policies[Role.DECODE]
    d_decision = None
    try:
        if decode_policy.uses_prefix:
            decode_route.matched_blocks = router.indexes[Role.DECODE].match(ex.route.block_hashes)
        d_decision = await decode_policy.schedule(decode_route, decodes)
    finally:
        if d_decision is None:  # no decode worker, or the client left meanwhile
            router.policies[Role.PREFILL].on_cancelled(ex.route, p_decision.worker)
    return None if d_decision is None else (p_decision, d_decision)


async def pd(router: Router, request: web.Request, ex: Exchange) -> web.StreamResponse:
    c = router.config
    path = UPSTREAM_PATHS[ex.endpoint]
    tried_p: list[Worker] = []
    tried_d: list[Worker] = []
    failure: UpstreamFailure | None = None
    decode_route = dataclasses.replace(ex.route)
    for attempt in range(c.max_attempts):
        now = time.monotonic()
        prefills = router.pool.candidates(Role.PREFILL, now, tried_p)
        decodes = router.pool.candidates(Role.DECODE, now, tried_d)
        if not prefills or not decodes:
            break
        decisions = await _decide(router, ex, decode_route, prefills, decodes)
        if decisions is None:
            break
        p, d = decisions[0].worker, decisions[1].worker
        decided(router, Role.PREFILL, ex, decisions[0], attempt)
        decided(router, Role.DECODE, ex, decisions[1], attempt)
        extra = _bootstrap(p, ex.batch)
        ex.record["bootstrap_room"] = extra["bootstrap_room"]
        rids = router.new_rids(ex.batch)
        payload = ex.payload(rids, extra)
        p_cost = ex.route.uncached_tokens(p)
        d_cost = ex.route.prompt_tokens + ex.route.output_tokens
        router.dispatch(ex.route, p, p_cost)
        router.dispatch(decode_route, d, d_cost)
        posted = time.perf_counter()
        ex.life.enter(Phase.PREFILL_SCHEDULED, posted)
        prefill = router.spawn(_prefill(router, ex, p, path, payload, posted))
        prefill.add_done_callback(lambda t, p=p, cost=p_cost: _release_prefill(
            router, ex, p, cost, t))
        ok = False
        try:
            out = await _attempt(router, request, ex, p, d, path, payload, rids, prefill)
            ok = True
            return out
        except Passthrough as pt:  # a worker refused the request: its partner stops too
            ok = True
            router.abort(d if prefill.done() else p, rids, "refused")
            return pt.response
        except UpstreamFailure as f:
            failure = f
            (tried_p if f.worker is p else tried_d).append(f.worker)
            if f.worker is d:
                router.record_failure(d, f.kind)
            ex.record.setdefault("failures", []).append(f"{f.worker.url}: {f}")
            # before any retry: the worker that failed, and its partner, stop this attempt
            router.abort(f.worker, rids, f.kind)
            if f.worker is p:
                router.abort(d, rids, "prefill_failed")
            elif not prefill.done():
                router.abort(p, rids, "decode_failed")
            prefill.cancel()
            if not f.retryable:
                break
            if attempt + 1 < c.max_attempts:
                router.metrics.retries.labels(f.worker.role.value, f.kind).inc()
                await backoff(router, attempt)
        except (asyncio.CancelledError, ConnectionResetError):
            ex.record["error"] = "client disconnected"
            prefill.cancel()
            router.abort(p, rids, "client_disconnected")
            router.abort(d, rids, "client_disconnected")
            raise
        finally:
            router.undispatch(decode_route, d, d_cost, ok)
    return no_worker(failure)


async def _attempt(router: Router, request: web.Request, ex: Exchange, p: Worker, d: Worker,
                   path: str, payload: bytes, rids: list[str],
                   prefill: PrefillTask) -> web.StreamResponse:
    decode = asyncio.ensure_future(_decode_open(router, ex, d, path, payload))
    pending: set[asyncio.Future[Any]] = {decode, prefill}
    try:
        while not decode.done():
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if prefill in done:
                _check_prefill(p, prefill, decode)
    except BaseException:
        decode.cancel()
        raise
    resp, first = decode.result()  # its UpstreamFailure/Passthrough: the caller aborts both
    if ex.stream:
        return await pipe(router, request, ex, resp, first, d,
                          on_upstream_error=lambda: prefill.done() or router.abort(
                              p, rids, "decode_failed"))
    data = first
    if ex.endpoint == "generate" and ex.body.get("return_logprob"):
        data = await _merge_input_logprobs(prefill, data)
    d.breaker.record_success()
    count_output(ex, data)
    return web.Response(body=data, headers=ex.headers,
                        content_type=resp.content_type or "application/json")


def _check_prefill(p: Worker, prefill: PrefillTask, decode: asyncio.Future[Any]) -> None:
    """A finished prefill that failed fails the attempt (the caller aborts its decode)."""
    exc = prefill.exception()
    if exc is None and prefill.result()[0] == 200:
        return
    decode.cancel()
    if exc is None:
        status, data = prefill.result()
        raise Passthrough(web.Response(status=status, body=data, content_type="application/json"))
    if isinstance(exc, UpstreamFailure):
        raise UpstreamFailure(p, exc.kind, f"prefill failed: {exc}", exc.retryable,
                              f"prefill failed: {exc.summary}")
    raise UpstreamFailure(p, "prefill", f"prefill failed: {exc!r}")


async def _decode_open(router: Router, ex: Exchange, d: Worker, path: str,
                       payload: bytes) -> tuple[Response, bytes]:
    """Decode response headers then its first chunk (stream) or whole body (non-stream)."""
    resp = await post(router, d, path, payload, ex.stream)
    ex.life.enter(Phase.DECODE_SCHEDULED)
    if ex.stream:
        return resp, await first_chunk(router, resp, d)
    return resp, await read_all(resp, d)


async def _merge_input_logprobs(prefill: PrefillTask, data: bytes) -> bytes:
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
