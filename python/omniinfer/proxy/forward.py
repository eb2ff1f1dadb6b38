"""One inference request through the router: parse, tokenize, match, admit, route, forward.

Every request gets exactly one answer: the worker's, or one clear error (400 bad input,
503 + Retry-After when saturated or no worker is available, 502 when the workers failed).
Failures before any byte reached the client are retried on another worker; after that the
stream ends with one error event. PD: the same body plus bootstrap_host/port/room goes to the
prefill and the decode worker at once; the client gets the decode stream as it comes, a failed
prefill aborts its decode, and a client that goes away aborts both.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
import uuid
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from omniinfer.proxy.accuracy import reported_cached_tokens, reported_from_stream
from omniinfer.proxy.admission import Rejected
from omniinfer.proxy.base import Decision, RouteRequest
from omniinfer.proxy.core import JSON_HEADERS, Router
from omniinfer.proxy.lifecycle import Lifecycle, Phase
from omniinfer.proxy.prefix import block_hashes
from omniinfer.proxy.tokenization import BadRequest, output_budget, prompt_tokens
from omniinfer.proxy.workers import Role, Worker

UPSTREAM_PATHS = {"generate": "/generate", "completions": "/v1/completions",
                  "chat": "/v1/chat/completions"}
ASYNC_TOKENIZE_CHARS = 16384
UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


def error_response(status: int, message: str, kind: str = "invalid_request_error",
                   retry_after: int | None = None) -> web.Response:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    body = {"error": {"message": message, "type": kind, "code": status}}
    return web.Response(status=status, body=orjson.dumps(body), headers=headers,
                        content_type="application/json")


class UpstreamFailure(Exception):
    """An attempt failed before any byte reached the client (so it may be retried)."""

    def __init__(self, worker: Worker, kind: str, message: str, retryable: bool = True) -> None:
        super().__init__(message)
        self.worker = worker
        self.kind = kind
        self.retryable = retryable


class Passthrough(Exception):
    """A worker refused the request itself (4xx): its answer goes to the client as is."""

    def __init__(self, response: web.Response) -> None:
        self.response = response


@dataclasses.dataclass
class Exchange:
    request_id: str
    endpoint: str
    body: dict[str, Any]
    stream: bool
    batch: int
    life: Lifecycle
    route: RouteRequest
    record: dict[str, Any]
    client_sent: bool = False
    output_events: int = 0
    tail: bytes = b""

    def rids(self, attempt: int) -> list[str]:
        base = self.request_id if attempt == 0 else f"{self.request_id}-r{attempt}"
        return [base] if self.batch == 1 else [f"{base}-{i}" for i in range(self.batch)]


async def handle(router: Router, request: web.Request, endpoint: str) -> web.StreamResponse:
    life = Lifecycle(uuid.uuid4().hex)
    status, record = 500, {"id": life.request_id, "endpoint": endpoint}
    try:
        try:
            exchange = await _prepare(router, request, endpoint, life, record)
        except BadRequest as exc:
            status = 400
            return error_response(400, str(exc))
        except web.HTTPRequestEntityTooLarge:
            status = 413
            return error_response(413, f"body larger than {router.config.max_payload_size} bytes")
        response = await _admitted(router, request, exchange)
        status = response.status
        return response
    except asyncio.CancelledError:
        status = 499  # the client went away; nobody is left to answer
        raise
    except Rejected as exc:
        status = 503
        router.metrics.rejected.labels(exc.reason).inc()
        return error_response(503, str(exc), "overloaded", retry_after=exc.retry_after)
    finally:
        life.finish()
        record["status"] = status
        router.metrics.observe(endpoint, status, life)
        if router.access_log is not None:
            _log_access(router, record, life)


async def _prepare(router: Router, request: web.Request, endpoint: str, life: Lifecycle,
                   record: dict[str, Any]) -> Exchange:
    raw = await request.read()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false")
    life.enter(Phase.TOKENIZE, life.arrival)
    tokenizer = router.tokenizer
    if len(raw) > ASYNC_TOKENIZE_CHARS:  # long prompts off the event loop (shared pool)
        prompts = await asyncio.get_running_loop().run_in_executor(
            None, prompt_tokens, endpoint, body, tokenizer)
    else:
        prompts = prompt_tokens(endpoint, body, tokenizer)
    if router.pd and endpoint == "generate" and body.get("n", 1) not in (1, None):
        raise BadRequest("'n' > 1 is not supported in PD mode")
    life.enter(Phase.APC_MATCHING)
    size = router.config.apc_block_size
    first = prompts[0]
    hashes = block_hashes(first, size)
    route = RouteRequest(life.request_id, sum(map(len, prompts)),
                         output_budget(endpoint, body, router.config.default_max_new_tokens)
                         * len(prompts), hashes, size, arrival=life.arrival, endpoint=endpoint)
    matched_role = Role.PREFILL if router.pd else Role.REGULAR
    route.matched_blocks = router.indexes[matched_role].match(hashes)
    rid = body.get("rid")
    request_id = rid if isinstance(rid, str) and rid else life.request_id
    record.update(stream=stream, prompt_tokens=route.prompt_tokens, batch=len(prompts),
                  rid=request_id)
    return Exchange(request_id, endpoint, body, stream, len(prompts), life, route, record)


async def _admitted(router: Router, request: web.Request, ex: Exchange) -> web.StreamResponse:
    ex.life.enter(Phase.PREFILL_WAITING)
    await router.admission.acquire()
    try:
        if router.pd:
            return await _pd(router, request, ex)
        return await _regular(router, request, ex)
    finally:
        router.admission.release()


def _decided(router: Router, role: Role, ex: Exchange, decision: Decision, attempt: int) -> None:
    policy = router.policies[role]
    router.metrics.decisions.labels(policy.name, role.value, decision.reason).inc()
    ex.record.setdefault("decisions", []).append(
        {"role": role.value, "worker": decision.worker.url, "reason": decision.reason,
         "policy": policy.name, "attempt": attempt,
         "cached_tokens": ex.route.cached_tokens(decision.worker)})


async def _backoff(router: Router, attempt: int) -> None:
    c = router.config
    delay = min(c.retry_max_backoff_ms, c.retry_initial_backoff_ms
                * c.retry_backoff_multiplier ** attempt) / 1000.0
    delay *= 1.0 + c.retry_jitter_factor * (2 * random.random() - 1)
    await asyncio.sleep(max(0.0, delay))


def _no_worker(failure: UpstreamFailure | None) -> web.Response:
    if failure is None:
        return error_response(503, "no healthy worker available", "unavailable", retry_after=1)
    return error_response(502, f"upstream {failure.worker.url} failed: {failure}", "upstream_error")


def _payload(ex: Exchange, attempt: int, extra: dict[str, Any] | None = None) -> tuple[bytes, list[str]]:
    body = dict(ex.body)
    rids = ex.rids(attempt)
    body["rid"] = rids[0] if ex.batch == 1 else rids
    if extra:
        body.update(extra)
    return orjson.dumps(body), rids


async def _post(router: Router, worker: Worker, path: str, payload: bytes) -> aiohttp.ClientResponse:
    """POST and return the response once headers are in; 5xx and transport errors raise."""
    assert router.session is not None
    try:
        resp = await router.session.post(
            worker.url + path, data=payload, headers=JSON_HEADERS,
            timeout=aiohttp.ClientTimeout(total=router.config.request_timeout_secs))
    except UPSTREAM_ERRORS as exc:
        raise UpstreamFailure(worker, "connect", f"{exc.__class__.__name__}: {exc}") from None
    if resp.status >= 500:
        try:
            text = (await resp.read())[:300].decode(errors="replace")
        except UPSTREAM_ERRORS:
            text = ""
        finally:
            resp.release()
        raise UpstreamFailure(worker, "status", f"HTTP {resp.status} {text}")
    if resp.status != 200:
        try:
            data = await resp.read()
        except UPSTREAM_ERRORS as exc:
            raise UpstreamFailure(worker, "read", str(exc)) from None
        finally:
            resp.release()
        worker.breaker.record_success()
        raise Passthrough(web.Response(status=resp.status, body=data,
                                       content_type=resp.content_type or "application/json"))
    return resp


async def _first_chunk(resp: aiohttp.ClientResponse, worker: Worker) -> bytes:
    try:
        chunk = await resp.content.readany()
    except UPSTREAM_ERRORS as exc:
        resp.close()
        raise UpstreamFailure(worker, "read", f"{exc.__class__.__name__}: {exc}") from None
    if not chunk:
        resp.close()
        raise UpstreamFailure(worker, "read", "stream ended before any data")
    return chunk


async def _read_all(resp: aiohttp.ClientResponse, worker: Worker) -> bytes:
    try:
        return await resp.read()
    except UPSTREAM_ERRORS as exc:
        raise UpstreamFailure(worker, "read", f"{exc.__class__.__name__}: {exc}") from None
    finally:
        resp.release()


def _count_output(ex: Exchange, data: bytes) -> None:
    """Output tokens from the final meta_info/usage; else the number of stream events."""
    count = 0
    try:
        if ex.stream:
            for line in reversed(data.split(b"\n")):
                line = line.strip()
                if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                    count = _completion_tokens(orjson.loads(line[5:].strip()))
                    break
        else:
            count = _completion_tokens(orjson.loads(data))
    except (orjson.JSONDecodeError, ValueError):
        count = 0
    ex.life.output_tokens = count or max(0, ex.output_events - 1 if ex.stream else 0)
    ex.record["output_tokens"] = ex.life.output_tokens


def _completion_tokens(obj: Any) -> int:
    if isinstance(obj, list):
        return sum(_completion_tokens(o) for o in obj)
    if not isinstance(obj, dict):
        return 0
    for key in ("meta_info", "usage"):
        inner = obj.get(key)
        if isinstance(inner, dict) and isinstance(inner.get("completion_tokens"), int):
            return int(inner["completion_tokens"])
    return 0


async def _pipe(router: Router, request: web.Request, ex: Exchange, resp: aiohttp.ClientResponse,
                first: bytes, worker: Worker, on_upstream_error: Any = None) -> web.StreamResponse:
    """Send the upstream stream to the client; a mid-stream failure ends it with one error."""
    out = web.StreamResponse(status=200, headers={
        "Content-Type": resp.headers.get("Content-Type", "text/event-stream"),
        "Cache-Control": "no-cache"})
    await out.prepare(request)
    ex.client_sent = True
    ex.life.token()
    ex.output_events = first.count(b"data:")
    tail = first
    await out.write(first)
    try:
        while True:
            try:
                chunk = await resp.content.readany()
            except UPSTREAM_ERRORS as exc:
                router.record_failure(worker, "mid_stream")
                ex.record["error"] = f"{worker.url} failed mid-stream: {exc.__class__.__name__}"
                if on_upstream_error is not None:
                    on_upstream_error()
                message = {"error": {"message": f"upstream worker failed mid-stream "
                                                f"({exc.__class__.__name__}); the output is "
                                                f"incomplete", "type": "upstream_error",
                                     "code": 502}}
                await out.write(b"data: " + orjson.dumps(message) + b"\n\ndata: [DONE]\n\n")
                break
            if not chunk:
                worker.breaker.record_success()
                break
            ex.output_events += chunk.count(b"data:")
            tail = tail[-2048:] + chunk if len(chunk) < 4096 else chunk[-4096:]
            await out.write(chunk)
        await out.write_eof()
    finally:
        resp.close()
    ex.tail = tail
    _count_output(ex, tail)
    return out


def _note_prediction(router: Router, ex: Exchange, worker: Worker, reported: int | None) -> None:
    """Predicted vs reported cached tokens of the worker that served a single prompt."""
    if ex.batch != 1:
        return  # the prediction is for the first prompt of a batch only
    predicted = ex.route.cached_tokens(worker)
    if reported is not None:
        ex.record["reported_cached_tokens"] = reported
    ex.record["cache_prediction"] = router.metrics.observe_prediction(
        router.cache_truth.label(worker), predicted, reported, ex.route.block_size)


# ---- regular mode ---------------------------------------------------------------------------
async def _regular(router: Router, request: web.Request, ex: Exchange) -> web.StreamResponse:
    policy, tried, failure = router.policies[Role.REGULAR], [], None
    path = UPSTREAM_PATHS[ex.endpoint]
    for attempt in range(router.config.max_attempts):
        workers = router.pool.candidates(Role.REGULAR, time.monotonic(), tried)
        decision = await policy.schedule(ex.route, workers) if workers else None
        if decision is None:
            break
        worker = decision.worker
        _decided(router, Role.REGULAR, ex, decision, attempt)
        cost = ex.route.uncached_tokens(worker) + ex.route.output_tokens
        router.dispatch(ex.route, worker, cost)
        ok = False
        payload, rids = _payload(ex, attempt)
        ex.life.enter(Phase.PREFILL_SCHEDULED)
        try:
            resp = await _post(router, worker, path, payload)
            ex.life.enter(Phase.PREFILL_RUNNING)
            if ex.stream:
                first = await _first_chunk(resp, worker)
                out = await _pipe(router, request, ex, resp, first, worker)
                _note_prediction(router, ex, worker, reported_from_stream(first, ex.tail))
            else:
                data = await _read_all(resp, worker)
                worker.breaker.record_success()
                _count_output(ex, data)
                out = web.Response(body=data, content_type=resp.content_type or "application/json")
                _note_prediction(router, ex, worker, reported_cached_tokens(data))
            ok = True
            return out
        except Passthrough as p:
            ok = True
            return p.response
        except UpstreamFailure as f:
            failure = f
            tried.append(worker)
            router.record_failure(worker, f.kind)
            ex.record.setdefault("failures", []).append(f"{worker.url}: {f}")
            if attempt + 1 < router.config.max_attempts:
                router.metrics.retries.labels("regular", f.kind).inc()
                await _backoff(router, attempt)
        except (asyncio.CancelledError, ConnectionResetError):
            router.abort(worker, rids, "client_disconnected")
            ex.record["error"] = "client disconnected"
            raise
        finally:
            router.undispatch(ex.route, worker, cost, ok)
    return _no_worker(failure)


# ---- PD mode --------------------------------------------------------------------------------
async def _prefill(router: Router, ex: Exchange, worker: Worker, path: str, payload: bytes,
                   posted: float) -> tuple[int, bytes]:
    """Run the prefill request to completion; (status, body); transport errors raise."""
    try:
        resp = await _post(router, worker, path, payload)
    except Passthrough as p:
        return p.response.status, bytes(p.response.body or b"")  # type: ignore[arg-type]
    ex.life.enter(Phase.PREFILL_RUNNING)
    data = await _read_all(resp, worker)
    now = time.perf_counter()
    ex.life.enter(Phase.DECODE_WAITING, now)
    worker.breaker.record_success()
    _note_prediction(router, ex, worker, reported_cached_tokens(data))
    router.policies[Role.PREFILL].on_prefill_done(ex.route, worker, now - posted)
    return 200, data


def _release_prefill(router: Router, ex: Exchange, worker: Worker, cost: int,
                     task: asyncio.Task[tuple[int, bytes]]) -> None:
    ok = not task.cancelled() and task.exception() is None and task.result()[0] == 200
    if not task.cancelled() and isinstance(task.exception(), UpstreamFailure):
        router.record_failure(worker, task.exception().kind)  # type: ignore[union-attr]
    router.undispatch(ex.route, worker, cost, ok)


async def _pd(router: Router, request: web.Request, ex: Exchange) -> web.StreamResponse:
    c = router.config
    path = UPSTREAM_PATHS[ex.endpoint]
    tried_p: list[Worker] = []
    tried_d: list[Worker] = []
    failure: UpstreamFailure | None = None
    decode_route = dataclasses.replace(ex.route)
    decode_policy = router.policies[Role.DECODE]
    for attempt in range(c.max_attempts):
        now = time.monotonic()
        prefills = router.pool.candidates(Role.PREFILL, now, tried_p)
        decodes = router.pool.candidates(Role.DECODE, now, tried_d)
        if not prefills or not decodes:
            break
        p_decision = await router.policies[Role.PREFILL].schedule(ex.route, prefills)
        if getattr(decode_policy, "uses_prefix", False):
            decode_route.matched_blocks = router.indexes[Role.DECODE].match(ex.route.block_hashes)
        d_decision = await decode_policy.schedule(decode_route, decodes)
        if p_decision is None or d_decision is None:
            break
        p, d = p_decision.worker, d_decision.worker
        _decided(router, Role.PREFILL, ex, p_decision, attempt)
        _decided(router, Role.DECODE, ex, d_decision, attempt)
        room = [random.getrandbits(63) for _ in range(ex.batch)]
        extra = {"bootstrap_host": p.host, "bootstrap_port": p.bootstrap_port,
                 "bootstrap_room": room[0]} if ex.batch == 1 else {
            "bootstrap_host": [p.host] * ex.batch, "bootstrap_port": [p.bootstrap_port] * ex.batch,
            "bootstrap_room": room}
        payload, rids = _payload(ex, attempt, extra)
        ex.record["bootstrap_room"] = room[0] if ex.batch == 1 else room
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
            out = await _pd_attempt(router, request, ex, p, d, path, payload, rids, prefill)
            ok = True
            return out
        except Passthrough as pt:
            ok = True
            return pt.response
        except UpstreamFailure as f:
            failure = f
            (tried_p if f.worker is p else tried_d).append(f.worker)
            if f.worker is d:
                router.record_failure(d, f.kind)
            ex.record.setdefault("failures", []).append(f"{f.worker.url}: {f}")
            if not f.retryable:
                break
            if attempt + 1 < c.max_attempts:
                router.metrics.retries.labels(f.worker.role.value, f.kind).inc()
                await _backoff(router, attempt)
        except (asyncio.CancelledError, ConnectionResetError):
            ex.record["error"] = "client disconnected"
            prefill.cancel()
            router.abort(p, rids, "client_disconnected")
            router.abort(d, rids, "client_disconnected")
            raise
        finally:
            router.undispatch(decode_route, d, d_cost, ok)
    return _no_worker(failure)


async def _pd_attempt(router: Router, request: web.Request, ex: Exchange, p: Worker, d: Worker,
                      path: str, payload: bytes, rids: list[str],
                      prefill: asyncio.Task[tuple[int, bytes]]) -> web.StreamResponse:
    decode = asyncio.ensure_future(_decode_open(router, ex, d, path, payload))
    pending: set[asyncio.Future[Any]] = {decode, prefill}
    try:
        while not decode.done():
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if prefill in done:
                _check_prefill(router, ex, p, d, rids, prefill, decode)
    except BaseException:
        decode.cancel()
        raise
    try:
        resp, first = decode.result()
    except (UpstreamFailure, Passthrough):
        if not prefill.done():
            router.abort(p, rids, "decode_failed")
        raise
    if ex.stream:
        return await _pipe(router, request, ex, resp, first, d,
                           on_upstream_error=lambda: prefill.done() or router.abort(
                               p, rids, "decode_failed"))
    data = first
    if ex.endpoint == "generate" and ex.body.get("return_logprob"):
        data = await _merge_input_logprobs(router, ex, p, d, rids, prefill, data)
    d.breaker.record_success()
    _count_output(ex, data)
    return web.Response(body=data, content_type=resp.content_type or "application/json")


def _check_prefill(router: Router, ex: Exchange, p: Worker, d: Worker, rids: list[str],
                   prefill: asyncio.Task[tuple[int, bytes]], decode: asyncio.Future[Any]) -> None:
    """A finished prefill that failed aborts its decode and fails the attempt."""
    exc = prefill.exception()
    if exc is None and prefill.result()[0] == 200:
        return
    decode.cancel()
    router.abort(d, rids, "prefill_failed")
    if exc is None:
        status, data = prefill.result()
        raise Passthrough(web.Response(status=status, body=data, content_type="application/json"))
    if isinstance(exc, UpstreamFailure):
        raise UpstreamFailure(p, exc.kind, f"prefill failed: {exc}")
    raise UpstreamFailure(p, "prefill", f"prefill failed: {exc!r}")


async def _decode_open(router: Router, ex: Exchange, d: Worker, path: str,
                       payload: bytes) -> tuple[aiohttp.ClientResponse, bytes]:
    """Decode response headers then its first chunk (stream) or whole body (non-stream)."""
    resp = await _post(router, d, path, payload)
    ex.life.enter(Phase.DECODE_SCHEDULED)
    if ex.stream:
        return resp, await _first_chunk(resp, d)
    return resp, await _read_all(resp, d)


async def _merge_input_logprobs(router: Router, ex: Exchange, p: Worker, d: Worker,
                                rids: list[str], prefill: asyncio.Task[tuple[int, bytes]],
                                data: bytes) -> bytes:
    """return_logprob: the prompt's logprobs come from the prefill worker's answer."""
    try:
        status, pdata = await asyncio.wait_for(asyncio.shield(prefill), 30.0)
        if status != 200:
            return data
        pre, dec = orjson.loads(pdata), orjson.loads(data)
    except (asyncio.TimeoutError, UpstreamFailure, orjson.JSONDecodeError):
        return data
    pairs = zip(pre, dec, strict=False) if isinstance(pre, list) and isinstance(dec, list) else [(pre, dec)]
    for a, b in pairs:
        if isinstance(a, dict) and isinstance(b, dict):
            am, bm = a.get("meta_info"), b.get("meta_info")
            if isinstance(am, dict) and isinstance(bm, dict) and "input_token_logprobs" in am:
                bm["input_token_logprobs"] = am["input_token_logprobs"]
    return orjson.dumps(dec)


def _log_access(router: Router, record: dict[str, Any], life: Lifecycle) -> None:
    record["arrival"] = round(life.arrival_wall, 6)
    record["phases"] = life.timestamps()
    record["durations"] = {k: round(v, 6) for k, v in life.durations().items()}
    ttft, e2e, tpot = life.ttft(), life.e2e(), life.tpot()
    record.update(ttft=ttft, e2e=e2e, tpot=tpot)
    assert router.access_log is not None
    router.access_log.write(record)
