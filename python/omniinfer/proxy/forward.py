"""One inference request through the router: read, tokenize, match, admit, route, forward.

Every request gets exactly one answer: the worker's, or one JSON error (400 bad input, 408 a
body too slow, 413 too large, 503 + Retry-After when saturated, when no worker is available or
when the router is shutting down, 502 when the workers failed; ``drain.py`` says what a
shutdown does to the requests in flight). Failures before any byte reached the client are
retried on another worker after the failed one was told to abort; after that the stream ends
with one error event.
The router names each request on the workers with rids of its own (fixed length, so none is a
prefix of another: SGLang aborts by prefix); the client's rid stays in the access log and in the
``X-Client-Rid`` header. The request is one ``Request`` (``request.py``); its attempts are
``attempt.py``'s loop with the mode's strategy (``regular.py``, ``pd.py``); the worker HTTP I/O
is in ``worker_http.py``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from omniinfer.proxy.admission import Rejected
from omniinfer.proxy.attempt import route
from omniinfer.proxy.auth import error_response
from omniinfer.proxy.core import Router
from omniinfer.proxy.pd import PD
from omniinfer.proxy.policy_api import RouteRequest
from omniinfer.proxy.prefix import block_hashes
from omniinfer.proxy.regular import Regular
from omniinfer.proxy.request import Phase, Request
from omniinfer.proxy.tokenization import BadRequest, output_budget, parse_body, prompt_tokens
from omniinfer.proxy.workers import Role

log = logging.getLogger("omniinfer.proxy")
INLINE_TOKENIZE_BYTES = 16384  # smaller bodies are tokenized on the loop (cheaper than a hop)
MAX_BATCH = 65536  # prompts in one request (rids carry a fixed-width index)
MAX_OUTPUT_TOKENS = 1 << 24  # a larger limit is counted as this much load


class BodyTimeout(Exception):
    """The client did not send its body within ``--client-body-timeout-secs``."""


def _request_id(request: web.Request, names: Sequence[str]) -> str | None:
    """The client's request id: the first of ``names`` present, if a short printable value."""
    for name in names:
        value = request.headers.get(name)
        if value is not None and (usable := _header_value(value)) is not None:
            return usable
    return None


def _error(req: Request, status: int, message: str, kind: str = "invalid_request_error",
           retry_after: int | None = None) -> web.Response:
    answer = error_response(status, message, kind, retry_after)
    answer.headers["X-Request-Id"] = req.request_id
    return answer


async def handle(router: Router, request: web.Request, endpoint: str) -> web.StreamResponse:
    req = Request(router.new_request_id(), endpoint)
    req.request_id = _request_id(request, router.request_id_headers) or req.id
    req.headers["X-Request-Id"] = req.request_id
    status = 500
    if router.drain.draining:
        status = 503
        router.metrics.rejected.labels("shutting_down").inc()
        router.metrics.observe(endpoint, status, req.life)
        refused = _error(req, 503, "the router is shutting down", "unavailable", retry_after=1)
        refused.force_close()
        return refused
    span = None
    if router.tracing is not None:
        try:  # tracing never costs a request
            span, req.trace_lines = router.tracing.begin(endpoint, request.headers,
                                                         req.request_id)
        except Exception as exc:
            log.warning("trace span not started: %s", exc)
    task = router.drain.enter()
    try:
        try:
            await _prepare(router, request, req)
        except BadRequest as exc:
            status = 400
            return _error(req, 400, str(exc))
        except BodyTimeout:
            status = 408
            return _error(req, 408, "request body not received in time")
        except web.HTTPRequestEntityTooLarge:
            status = 413
            return _error(req, 413, f"body larger than {router.config.max_payload_size} bytes")
        strategy = (PD if router.pd else Regular)(router, request, req)
        response = await route(router, strategy)
        status = response.status
        if not response.prepared:  # the router's own answers and passed-through ones too
            for name, value in req.headers.items():
                response.headers.setdefault(name, value)
        return response
    except (asyncio.CancelledError, ConnectionError) as exc:
        if isinstance(exc, asyncio.CancelledError) and router.drain.take_cut() \
                and not req.begun:
            status = 503  # cut by the shutdown before any byte was sent: one error answer
            req.error = req.error or "cut by the router's shutdown"
            return _error(req, 503, "the router shut down before the answer began",
                          "unavailable", retry_after=1)
        # the client went away; nobody is left to answer (unless it had its whole answer)
        status = 200 if req.delivered else 499
        raise
    except Rejected as exc:
        status = exc.status
        router.metrics.rejected.labels(exc.reason).inc()
        return _error(req, exc.status, str(exc), "overloaded", retry_after=exc.retry_after)
    finally:
        router.drain.leave(task)
        req.finish(status)
        router.metrics.observe(endpoint, status, req.life)
        if router.access_log is not None or span is not None:
            record = req.access_record()
            if router.access_log is not None:
                router.access_log.write(record)
            if span is not None and router.tracing is not None:
                router.tracing.end(span, status, record)


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


def _header_value(rid: Any) -> str | None:
    """``rid`` as a header value, if it is a short printable ASCII string."""
    if isinstance(rid, str) and 0 < len(rid) <= 256 and rid.isprintable() and rid.isascii():
        return rid
    return None


async def _prepare(router: Router, request: web.Request, req: Request) -> None:
    """Read, parse and tokenize the body, match its blocks: ``req`` prepared, or BadRequest."""
    endpoint, life = req.endpoint, req.life
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
    if len(prompts) > MAX_BATCH:
        raise BadRequest(f"at most {MAX_BATCH} prompts per request")
    if router.pd and _samples(endpoint, body) != 1:
        raise BadRequest("'n' > 1 is not supported in PD mode (one decode per prefill)")
    life.enter(Phase.APC_MATCHING)
    budget = min(MAX_OUTPUT_TOKENS, output_budget(endpoint, body,
                                                  router.config.default_max_new_tokens))
    route = RouteRequest(req.id, sum(map(len, prompts)), budget * len(prompts), hashes,
                         size, arrival=life.arrival, endpoint=endpoint)
    route.matched_blocks = router.indexes[Role.PREFILL if router.pd else Role.REGULAR].match(
        hashes)
    req.prepare(body, len(prompts), route)
    echoed = _header_value(req.client_rid)
    if echoed is not None:
        req.headers["X-Client-Rid"] = echoed
