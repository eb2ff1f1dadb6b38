"""One inference request through the router: read, tokenize, match, admit, route, forward.

Every request gets exactly one answer: the worker's, or one JSON error (400 bad input, 408 a
body too slow, 413 too large, 503 + Retry-After when saturated or no worker is available, 502
when the workers failed). Failures before any byte reached the client are retried on another
worker after the failed one was told to abort; after that the stream ends with one error event.
The router names each request on the workers with rids of its own (fixed length, so none is a
prefix of another: SGLang aborts by prefix); the client's rid stays in the access log and in the
``X-Client-Rid`` header. Upstream I/O is in ``upstream.py``, the PD pairing in ``pd.py``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from aiohttp import web

from omniinfer.proxy.accuracy import (
    cached_tokens_in,
    reported_cached_tokens,
    reported_from_stream,
)
from omniinfer.proxy.admission import Rejected
from omniinfer.proxy.attempts import backoff, decided, no_worker, note_prediction
from omniinfer.proxy.auth import error_response
from omniinfer.proxy.base import RouteRequest
from omniinfer.proxy.core import Router
from omniinfer.proxy.lifecycle import Lifecycle, Phase
from omniinfer.proxy.pd import pd
from omniinfer.proxy.prefix import block_hashes
from omniinfer.proxy.tokenization import BadRequest, output_budget, parse_body, prompt_tokens
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
from omniinfer.proxy.workers import Role

log = logging.getLogger("omniinfer.proxy")
INLINE_TOKENIZE_BYTES = 16384  # smaller bodies are tokenized on the loop (cheaper than a hop)
MAX_BATCH = 65536  # prompts in one request (rids carry a fixed-width index)
MAX_OUTPUT_TOKENS = 1 << 24  # a larger limit is counted as this much load


class BodyTimeout(Exception):
    """The client did not send its body within ``--client-body-timeout-secs``."""


async def handle(router: Router, request: web.Request, endpoint: str) -> web.StreamResponse:
    life = Lifecycle(router.new_request_id())
    status, record = 500, {"id": life.request_id, "endpoint": endpoint}
    try:
        try:
            exchange = await _prepare(router, request, endpoint, life, record)
        except BadRequest as exc:
            status = 400
            return error_response(400, str(exc))
        except BodyTimeout:
            status = 408
            return error_response(408, "request body not received in time")
        except web.HTTPRequestEntityTooLarge:
            status = 413
            return error_response(413, f"body larger than {router.config.max_payload_size} bytes")
        response = await _admitted(router, request, exchange)
        status = response.status
        return response
    except asyncio.CancelledError:
        status = 499  # the client went away; nobody is left to answer
        raise
    except ConnectionError:
        status = 499
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


async def _read_body(router: Router, request: web.Request) -> bytes:
    """The body, its size checked before reading and its arrival bounded in time."""
    c = router.config
    if request.content_length is not None and request.content_length > c.max_payload_size:
        raise web.HTTPRequestEntityTooLarge(max_size=c.max_payload_size,
                                            actual_size=request.content_length)
    if request.content.is_eof():  # the whole body came with the head: nothing to wait for
        return await request.read()
    try:
        async with asyncio.timeout(c.client_body_timeout_secs):
            return await request.read()
    except TimeoutError:
        raise BodyTimeout from None


def _samples(endpoint: str, body: dict[str, Any]) -> Any:
    """Samples per prompt where SGLang reads them: ``sampling_params.n`` (a list of sampling
    params on a batch: each one's) on /generate, ``n`` on the OpenAI routes; 1 if unset."""
    if endpoint != "generate":
        n = body.get("n")
        return 1 if n is None else n
    params = body.get("sampling_params")
    for one in params if isinstance(params, list) else [params]:
        n = one.get("n") if isinstance(one, dict) else None
        if n is not None and n != 1:
            return n
    return 1


def _client_rid_header(rid: Any) -> str | None:
    """The client's rid as a header value, if it is a short printable string."""
    if isinstance(rid, str) and 0 < len(rid) <= 256 and rid.isprintable() and rid.isascii():
        return rid
    return None


async def _prepare(router: Router, request: web.Request, endpoint: str, life: Lifecycle,
                   record: dict[str, Any]) -> Exchange:
    raw = await _read_body(router, request)
    life.enter(Phase.TOKENIZE, life.arrival)
    size = router.config.apc_block_size
    try:
        if len(raw) > INLINE_TOKENIZE_BYTES:  # parsed, tokenized, hashed off the loop, bounded
            body, prompts, hashes = await router.tokenize(endpoint, raw)
        else:
            body = parse_body(endpoint, raw)
            prompts = prompt_tokens(endpoint, body, router.tokenizer)
            hashes = block_hashes(prompts[0], size)
    except BadRequest:
        raise
    except (TypeError, ValueError, RecursionError, OverflowError) as exc:
        raise BadRequest(f"the prompt cannot be tokenized: {exc}") from None
    stream = body.get("stream", False)
    if len(prompts) > MAX_BATCH:
        raise BadRequest(f"at most {MAX_BATCH} prompts per request")
    if router.pd and _samples(endpoint, body) != 1:
        raise BadRequest("'n' > 1 is not supported in PD mode (one decode per prefill)")
    life.enter(Phase.APC_MATCHING)
    budget = min(MAX_OUTPUT_TOKENS, output_budget(endpoint, body,
                                                  router.config.default_max_new_tokens))
    route = RouteRequest(life.request_id, sum(map(len, prompts)), budget * len(prompts), hashes,
                         size, arrival=life.arrival, endpoint=endpoint)
    route.matched_blocks = router.indexes[Role.PREFILL if router.pd else Role.REGULAR].match(
        hashes)
    client_rid = body.get("rid")
    record.update(stream=stream, prompt_tokens=route.prompt_tokens, batch=len(prompts))
    if client_rid is not None:
        record["client_rid"] = client_rid
    headers = {}
    echoed = _client_rid_header(client_rid)
    if echoed is not None:
        headers["X-Client-Rid"] = echoed
    return Exchange(endpoint, body, stream, len(prompts), life, route, record, headers)


async def _admitted(router: Router, request: web.Request, ex: Exchange) -> web.StreamResponse:
    ex.life.enter(Phase.PREFILL_WAITING)
    await router.admission.acquire()
    try:
        if router.pd:
            return await pd(router, request, ex)
        return await _regular(router, request, ex)
    finally:
        router.admission.release()


async def _regular(router: Router, request: web.Request, ex: Exchange) -> web.StreamResponse:
    policy, tried, failure = router.policies[Role.REGULAR], [], None
    path = UPSTREAM_PATHS[ex.endpoint]
    for attempt in range(router.config.max_attempts):
        workers = router.pool.candidates(Role.REGULAR, time.monotonic(), tried)
        decision = await policy.schedule(ex.route, workers) if workers else None
        if decision is None:
            break
        worker = decision.worker
        decided(router, Role.REGULAR, ex, decision, attempt)
        rids = router.new_rids(ex.batch)
        payload = ex.payload(rids)
        cost = ex.route.uncached_tokens(worker) + ex.route.output_tokens
        router.dispatch(ex.route, worker, cost)
        ok = False
        try:
            ex.life.enter(Phase.PREFILL_SCHEDULED)
            posted = time.perf_counter()
            resp = await post(router, worker, path, payload, ex.stream)
            ex.life.enter(Phase.PREFILL_RUNNING)
            if ex.stream:
                first = await first_chunk(router, resp, worker)
                # the first event is the end of this request's prefill: the policy's clock of
                # that instance closes it now, not when the whole answer is back
                policy.on_prefill_done(ex.route, worker, time.perf_counter() - posted)
                out = await pipe(router, request, ex, resp, first, worker)
                note_prediction(router, ex, worker, reported_from_stream(first, ex.tail))
            else:
                data = await read_all(resp, worker)
                worker.breaker.record_success()
                answer = count_output(ex, data)
                out = web.Response(body=data, headers=ex.headers,
                                   content_type=resp.content_type or "application/json")
                note_prediction(router, ex, worker, reported_cached_tokens(data)
                                if answer is None else cached_tokens_in(answer))
            ok = True
            return out
        except Passthrough as p:
            ok = True
            return p.response
        except UpstreamFailure as f:
            failure = f
            tried.append(worker)
            router.record_failure(worker, f.kind)
            router.abort(worker, rids, f.kind)  # before any retry: the work must not run twice
            ex.record.setdefault("failures", []).append(f"{worker.url}: {f}")
            if not f.retryable:
                break
            if attempt + 1 < router.config.max_attempts:
                router.metrics.retries.labels("regular", f.kind).inc()
                await backoff(router, attempt)
        except (asyncio.CancelledError, ConnectionResetError):
            router.abort(worker, rids, "client_disconnected")
            ex.record["error"] = "client disconnected"
            raise
        finally:
            router.undispatch(ex.route, worker, cost, ok)
    return no_worker(failure)


def _log_access(router: Router, record: dict[str, Any], life: Lifecycle) -> None:
    record["arrival"] = round(life.arrival_wall, 6)
    record["phases"] = life.timestamps()
    record["durations"] = {k: round(v, 6) for k, v in life.durations().items()}
    ttft, e2e, tpot = life.ttft(), life.e2e(), life.tpot()
    record.update(ttft=ttft, e2e=e2e, tpot=tpot)
    assert router.access_log is not None
    router.access_log.write(record)
