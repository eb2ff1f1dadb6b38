"""The router's HTTP I/O with its workers for one request: POST to a worker, read its answer,
pipe a stream to the client.

Timeouts, so that no worker can hold a slot forever: connect (``--upstream-connect-timeout-
secs``), the first event of a stream (``--upstream-first-byte-timeout-secs``), each later read of
a stream (``--upstream-idle-timeout-secs``), and sglang_router's ``--request-timeout-secs`` as the
total of one attempt (a non-streamed answer comes whole, so only the total bounds it); a stream's
answer head is due within the first-byte timeout too. A non-streamed answer larger than
``--max-response-size`` fails the attempt without a retry (it would be as large elsewhere). Failures
before any byte reached the client raise ``UpstreamFailure`` (the caller may retry elsewhere); a
worker's own 4xx raises ``Passthrough`` and goes to the client as is; of a 5xx body at most
about a megabyte is read (the reader's pause threshold), only for the log.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from omniinfer.proxy.http1_response import Response, UpstreamTooLarge
from omniinfer.proxy.request import Request
from omniinfer.proxy.strategy import Event, Outbox
from omniinfer.proxy.workers import Worker

if TYPE_CHECKING:
    from omniinfer.proxy.core import Router

UPSTREAM_ERRORS = (asyncio.TimeoutError, OSError)
ERROR_TEXT_CAP = 64 * 1024  # a 5xx body is read for its first 300 characters, not relayed
UPSTREAM_PATHS = {"generate": "/generate", "completions": "/v1/completions",
                  "chat": "/v1/chat/completions"}


class UpstreamFailure(Exception):
    """An attempt failed before any byte reached the client (so it may be retried)."""

    def __init__(self, worker: Worker, kind: str, message: str, retryable: bool = True,
                 summary: str | None = None) -> None:
        super().__init__(message)
        self.worker = worker
        self.kind = kind
        self.retryable = retryable
        self.summary = summary or kind  # what a client may read: no URL, no worker text


class Passthrough(Exception):
    """``worker`` refused the request itself (4xx): its answer goes to the client as is."""

    def __init__(self, response: web.Response, worker: Worker) -> None:
        self.response = response
        self.worker = worker


def _failure(worker: Worker, kind: str, exc: BaseException) -> UpstreamFailure:
    if isinstance(exc, asyncio.TimeoutError):
        kind = "timeout"
    return UpstreamFailure(worker, kind, f"{exc.__class__.__name__}: {exc}")


async def post(router: Router, worker: Worker, path: str, payload: bytes,
               stream: bool, extra: bytes = b"") -> Response:
    """POST and return the response once headers are in; 5xx and transport errors raise."""
    c = router.config
    try:
        resp = await router.http.post(worker.url, path, payload, stream=stream,
                                      connect_timeout=c.upstream_connect_timeout_secs,
                                      total_timeout=c.request_timeout_secs,
                                      head_timeout=c.upstream_first_byte_timeout_secs
                                      if stream else None, extra=extra)
    except UPSTREAM_ERRORS as exc:
        raise _failure(worker, "connect", exc) from None
    if resp.status >= 500:
        resp.limit = min(resp.limit, ERROR_TEXT_CAP)  # only its start is logged
        try:
            text = (await resp.read())[:300].decode(errors="replace")
        except UPSTREAM_ERRORS:
            text = ""
        finally:
            resp.release()
        raise UpstreamFailure(worker, "status", f"HTTP {resp.status} {text}",
                              summary=f"HTTP {resp.status}")
    if resp.status != 200:
        try:
            data = await resp.read()
        except UPSTREAM_ERRORS as exc:
            raise _failure(worker, "read", exc) from None
        finally:
            resp.release()
        if resp.status in (401, 403):  # the router's key, not the client's fault
            raise UpstreamFailure(worker, "auth", f"HTTP {resp.status}: check --api-key")
        raise Passthrough(web.Response(status=resp.status, body=data,
                                       content_type=resp.content_type or "application/json"),
                          worker)
    return resp


async def first_chunk(router: Router, resp: Response, worker: Worker) -> bytes:
    """A stream's first event, within ``--upstream-first-byte-timeout-secs``."""
    try:
        chunk = await resp.readany(router.config.upstream_first_byte_timeout_secs)
    except UPSTREAM_ERRORS as exc:
        resp.close()
        raise _failure(worker, "read", exc) from None
    if not chunk:
        resp.close()
        raise UpstreamFailure(worker, "read", "stream ended before any data")
    return chunk


async def read_all(resp: Response, worker: Worker) -> bytes:
    try:
        return await resp.read()
    except UpstreamTooLarge as exc:
        raise UpstreamFailure(worker, "too_large", str(exc), retryable=False,
                              summary="the answer is larger than --max-response-size") from None
    except UPSTREAM_ERRORS as exc:
        raise _failure(worker, "read", exc) from None
    finally:
        resp.release()


def count_output(req: Request, data: bytes) -> Any:
    """Output tokens from the final meta_info/usage; else the number of stream events.

    Returns a non-streamed answer's decoded JSON (None if it is none), so that it is read once."""
    count, answer = 0, None
    try:
        if req.stream:
            for line in reversed(data.split(b"\n")):
                line = line.strip()
                if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                    count = completion_tokens(orjson.loads(line[5:].strip()))
                    break
        else:
            answer = orjson.loads(data)
            count = completion_tokens(answer)
    except (orjson.JSONDecodeError, ValueError):
        count = 0
    req.counted(count or max(0, req.output_events - 1 if req.stream else 0))
    return answer


def completion_tokens(obj: Any) -> int:
    if isinstance(obj, list):
        return sum(completion_tokens(o) for o in obj)
    if not isinstance(obj, dict):
        return 0
    for key in ("meta_info", "usage"):
        inner = obj.get(key)
        if isinstance(inner, dict) and isinstance(inner.get("completion_tokens"), int):
            return int(inner["completion_tokens"])
    return 0


DONE = b"data: [DONE]"


def _error_event(message: str, kind: str, code: int) -> bytes:
    """A stream's last two events: one error, then ``[DONE]``."""
    body = {"error": {"message": message, "type": kind, "code": code}}
    return b"data: " + orjson.dumps(body) + b"\n\ndata: [DONE]\n\n"


async def pipe(out: Outbox, worker: Worker, resp: Response, first: bytes) -> web.StreamResponse:
    """Send ``worker``'s stream (``first``, its first event, then the rest of ``resp``) to the
    attempt's client; a mid-stream failure, or the router's shutdown cutting it (``drain.py``),
    ends it with one error event and ``[DONE]``. What happened is reported to ``out``
    (``FIRST_TOKEN``, then ``STREAM_END``, ``STREAM_FAILED`` or ``STREAM_CUT``): the attempt
    counts it and aborts whom it must.

    Streaming clients stop reading at ``data: [DONE]`` and close, often before the worker's
    stream or the chunked terminator has ended: once that event was written the answer is
    delivered (``req.delivered``), and a disconnect after it is no failure."""
    router, req = out.router, out.request
    answer = web.StreamResponse(status=200, headers={
        "Content-Type": resp.headers.get("content-type", "text/event-stream"),
        "Cache-Control": "no-cache", **req.headers})
    idle = router.config.upstream_idle_timeout_secs
    tail = first
    try:
        req.begun = True
        await answer.prepare(out.client)
        out.report(Event.FIRST_TOKEN, worker)
        req.output_events = first.count(b"data:")
        await answer.write(first)
        req.delivered = DONE in first
        while True:
            try:
                chunk = await resp.readany(idle)
            except UPSTREAM_ERRORS as exc:
                kind = "idle_timeout" if isinstance(exc, asyncio.TimeoutError) else "mid_stream"
                out.report(Event.STREAM_FAILED, worker, (kind, exc.__class__.__name__))
                await answer.write(_error_event(f"upstream worker failed mid-stream ("
                                                f"{exc.__class__.__name__}); the output is "
                                                "incomplete", "upstream_error", 502))
                break
            if not chunk:
                out.report(Event.STREAM_END, worker)
                break
            req.output_events += chunk.count(b"data:")
            tail = tail[-2048:] + chunk if len(chunk) < 4096 else chunk[-4096:]
            await answer.write(chunk)
            req.delivered = req.delivered or DONE in tail[-len(chunk) - len(DONE):]
        try:
            await answer.write_eof()
        except ConnectionResetError:
            if not req.delivered:
                raise
    except (asyncio.CancelledError, ConnectionResetError) as exc:
        if isinstance(exc, asyncio.CancelledError) and answer.prepared and not req.delivered \
                and router.drain.take_cut():
            # the router is shutting down: the stream ends with one error, the workers stop
            out.report(Event.STREAM_CUT, worker)
            boundary = b"" if tail.endswith(b"\n\n") else b"\n\n"  # end a torn event first
            await answer.write(boundary + _error_event("the router is shutting down; the "
                                                       "output is incomplete", "shutdown", 503))
            await answer.write_eof()
        else:
            if req.delivered:  # the client left after its last event: count what it got
                req.tail = tail
                count_output(req, tail)
            raise
    finally:
        resp.close()
    req.tail = tail
    count_output(req, tail)
    return answer
