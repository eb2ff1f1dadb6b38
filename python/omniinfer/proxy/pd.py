"""PD mode: each attempt sends one request through a prefill and a decode worker at once.

The same body plus bootstrap_host/port/room goes to both; the client gets the decode stream as
it comes. The prefill request runs in the background (``Outbox.background``: its booking lasts
until it ends, which may be after the decode answer); a prefill that fails fails the attempt. A
prefill booking costs its uncached prompt tokens, a decode one the whole prompt plus the output
budget. What an attempt aborts, retries, marks and gives back is the attempt's (``attempt.py``).

The events reported (``strategy.Event``), which make the PD phases after prefill_scheduled: the
prefill worker's response head (``HEAD``) and its completed answer, the prefill done
(``ANSWER``); the decode worker's first output (``OUTPUT``: a stream's first event, a
non-streamed answer's head) and, non-streamed, that answer read whole (``ANSWER``), streamed,
its first event sent to the client (``FIRST_TOKEN``, by ``worker_http.pipe``). The decode
worker's stream head is no event: SGLang sends it at once, while the prefill runs.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from omniinfer.proxy.accuracy import reported_cached_tokens
from omniinfer.proxy.http1_response import Response
from omniinfer.proxy.policy_api import RouteRequest
from omniinfer.proxy.request import Request
from omniinfer.proxy.strategy import Event, HeldTask, Outbox, Strategy
from omniinfer.proxy.worker_http import (
    UPSTREAM_PATHS,
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
        self.path = UPSTREAM_PATHS[request.endpoint]
        self.prefill_matched = dict(request.route.matched_blocks)  # on the prefill index

    def view(self, role: Role) -> RouteRequest:
        """Both roles see the request's one view. Its matched blocks (by worker URL) are the
        prefill index's; when the decode's turn comes (the prefill decided) and the decode
        policy uses prefixes, the decode index's matches of this attempt join them (a worker
        URL serves one role, so neither hides the other)."""
        route = self.request.route
        if role is Role.PREFILL:  # a retry's prefill turn: the prefill index's alone again
            route.matched_blocks = self.prefill_matched
        elif self.router.policies[Role.DECODE].uses_prefix:
            route.matched_blocks = {**self.prefill_matched,
                                    **self.router.indexes[Role.DECODE].match(route.block_hashes)}
        return route

    def cost(self, worker: Worker) -> int:
        route = self.request.route
        if worker.role is Role.PREFILL:
            return route.uncached_tokens(worker)
        return route.prompt_tokens + route.output_tokens

    def fields(self, workers: Sequence[Worker]) -> dict[str, Any]:
        return _bootstrap(workers[0], self.request.batch)

    async def send(self, out: Outbox) -> web.StreamResponse:
        req = self.request
        p, d = out.workers
        out.report(Event.POSTED, p)
        prefill = out.background(p, self._prefill(out, p))
        decode = asyncio.ensure_future(self._decode_open(out, d))
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
            return await pipe(out, d, resp, first)
        data = first
        if req.endpoint == "generate" and req.body.get("return_logprob"):
            data = await _merge_input_logprobs(prefill, data)
        out.report(Event.ANSWER, d)
        count_output(req, data)
        return web.Response(body=data, headers=req.headers,
                            content_type=resp.content_type or "application/json")

    async def _prefill(self, out: Outbox, worker: Worker) -> tuple[int, bytes]:
        """The prefill request run to completion: (status, body); transport errors raise."""
        try:
            resp = await post(self.router, worker, self.path, out.payload(worker),
                              stream=False, extra=self.request.trace_lines)
        except Passthrough as p:
            return p.response.status, bytes(p.response.body or b"")  # type: ignore[arg-type]
        out.report(Event.HEAD, worker)
        data = await read_all(resp, worker)
        out.report(Event.ANSWER, worker)
        out.report(Event.CACHED, worker, reported_cached_tokens(data))
        return 200, data

    async def _decode_open(self, out: Outbox, d: Worker) -> tuple[Response, bytes]:
        """Decode response headers then its first chunk (stream) or whole body (non-stream).

        Its first output is reported: a stream's first event (its head comes at once, before
        the prefill is done), a non-streamed answer's head (sent with the answer, once
        decoded)."""
        req = self.request
        resp = await post(self.router, d, self.path, out.payload(d), req.stream, req.trace_lines)
        if req.stream:
            first = await first_chunk(self.router, resp, d)
            out.report(Event.OUTPUT, d)
            return resp, first
        out.report(Event.OUTPUT, d)
        return resp, await read_all(resp, d)


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
