"""Regular mode: each attempt posts the request to one worker, whose answer goes to the client.

A booking costs the prompt tokens the worker cannot reuse plus the output budget. A stream's
first event ends the worker's prefill (``Event.OUTPUT``: its policy learns the time then, not
when the whole answer is back); the cache prediction is checked against the usage the worker
reports (``Event.CACHED``). What each event does is the attempt's (``strategy.py``).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from omniinfer.proxy.accuracy import cached_tokens_in, reported_cached_tokens, reported_from_stream
from omniinfer.proxy.policy_api import RouteRequest
from omniinfer.proxy.request import REGULAR_PHASES
from omniinfer.proxy.strategy import Event, Outbox, Strategy
from omniinfer.proxy.worker_http import (
    UPSTREAM_PATHS,
    count_output,
    first_chunk,
    pipe,
    post,
    read_all,
)
from omniinfer.proxy.workers import Role, Worker


class Regular(Strategy):
    """One worker per attempt; its response head starts prefill_running, a stream's first event
    sent to the client decode_running (``REGULAR_PHASES``: no decode_waiting/scheduled)."""

    roles = (Role.REGULAR,)
    phases = REGULAR_PHASES

    def view(self, role: Role) -> RouteRequest:
        return self.request.route

    def cost(self, worker: Worker) -> int:
        route = self.request.route
        return route.uncached_tokens(worker) + route.output_tokens

    async def send(self, out: Outbox) -> web.StreamResponse:
        router, req = self.router, self.request
        worker = out.workers[0]
        out.report(Event.POSTED, worker)
        resp = await post(router, worker, UPSTREAM_PATHS[req.endpoint], out.payload(worker),
                          req.stream, req.trace_lines)
        out.report(Event.HEAD, worker)
        if req.stream:
            first = await first_chunk(router, resp, worker)
            out.report(Event.OUTPUT, worker)
            answer = await pipe(out, worker, resp, first)
            out.report(Event.CACHED, worker, reported_from_stream(first, req.tail))
            return answer
        data = await read_all(resp, worker)
        out.report(Event.ANSWER, worker)
        body: Any = count_output(req, data)
        response = web.Response(body=data, headers=req.headers,
                                content_type=resp.content_type or "application/json")
        out.report(Event.CACHED, worker, reported_cached_tokens(data) if body is None
                   else cached_tokens_in(body))
        return response
