"""Regular mode: each attempt posts the request to one worker, whose answer goes to the client.

A booking costs the prompt tokens the worker cannot reuse plus the output budget. A stream's
first event ends the worker's prefill (its policy learns the time then, not when the whole
answer is back); the cache prediction is checked against the usage the worker reports.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from omniinfer.proxy.accuracy import cached_tokens_in, reported_cached_tokens, reported_from_stream
from omniinfer.proxy.attempt import Attempt, Strategy, decide_in_turn
from omniinfer.proxy.policy_api import Decision, RouteRequest
from omniinfer.proxy.request import REGULAR_PHASES, Phase
from omniinfer.proxy.worker_http import count_output, first_chunk, pipe, post, read_all
from omniinfer.proxy.workers import Role, Worker


class Regular(Strategy):
    """One worker per attempt; its response head starts prefill_running, a stream's first event
    sent to the client decode_running (``REGULAR_PHASES``: no decode_waiting/scheduled)."""

    roles = (Role.REGULAR,)
    phases = REGULAR_PHASES

    async def decide(self, candidates: dict[Role, list[Worker]]) -> list[Decision] | None:
        route = self.request.route
        return await decide_in_turn(self.router,
                                    [(Role.REGULAR, lambda: route, candidates[Role.REGULAR])])

    def cost(self, decision: Decision) -> tuple[RouteRequest, int]:
        route = self.request.route
        return route, route.uncached_tokens(decision.worker) + route.output_tokens

    async def send(self, attempt: Attempt) -> web.StreamResponse:
        router, req = self.router, self.request
        worker = attempt.bookings[0].worker
        attempt.scheduled()
        resp = await post(router, worker, self.path, attempt.payload_for(worker), req.stream,
                          req.trace_lines)
        req.life.enter(Phase.PREFILL_RUNNING)
        if req.stream:
            first = await first_chunk(router, resp, worker)
            attempt.prefill_done(worker)
            out = await pipe(router, self.client, req, resp, first, worker)
            attempt.cache_reported(worker, reported_from_stream(first, req.tail))
            return out
        data = await read_all(resp, worker)
        worker.breaker.record_success()
        answer: Any = count_output(req, data)
        out = web.Response(body=data, headers=req.headers,
                           content_type=resp.content_type or "application/json")
        attempt.cache_reported(worker, reported_cached_tokens(data) if answer is None
                               else cached_tokens_in(answer))
        return out
