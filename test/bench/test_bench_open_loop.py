"""The load generators put every request on the wire: no client-side cap on connections.

A server that answers only once ``OPEN`` requests are open at the same time tells whether
the client sent them all; aiohttp's default connector stops at 100, and the requests past it
would wait in the client with their clocks running, unseen by the router they measure.
"""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from omniinfer.bench.runner import run_closed_loop, run_trace_replay
from omniinfer.bench.workloads import BenchRequest

OPEN = 150  # more than aiohttp's default connector allows (100)
WAIT_S = 5.0  # how long the server waits for the others before it answers anyway


class GatedServer:
    """/generate answers once ``OPEN`` requests are open at once, or after ``WAIT_S``."""

    def __init__(self) -> None:
        self.open = 0
        self.most_open = 0
        self.everyone: asyncio.Event | None = None

    async def generate(self, request: web.Request) -> web.StreamResponse:
        assert self.everyone is not None
        await request.json()
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        if self.open >= OPEN:
            self.everyone.set()
        try:
            await asyncio.wait_for(self.everyone.wait(), WAIT_S)
        except TimeoutError:
            pass
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        event = {"text": "x", "meta_info": {"completion_tokens": 1}}
        await response.write(f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode())
        self.open -= 1
        return response


async def _serve(load: str) -> tuple[GatedServer, list]:
    gated = GatedServer()
    gated.everyone = asyncio.Event()
    app = web.Application()
    app.router.add_post("/generate", gated.generate)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    requests = [BenchRequest(i, 4, 1, input_ids=(1, 2, 3, 4)) for i in range(OPEN)]
    url = f"http://127.0.0.1:{port}"
    try:
        if load == "open":
            results, _ = await run_trace_replay(url, requests, progress=False, timeout_s=60)
        else:
            results, _ = await run_closed_loop(url, requests, OPEN, progress=False,
                                               timeout_s=60)
    finally:
        await runner.cleanup()
    return gated, results


def test_open_loop_sends_every_request_at_its_arrival() -> None:
    gated, results = asyncio.run(_serve("open"))
    assert gated.most_open == OPEN
    assert all(r.error is None and r.ttft is not None for r in results)
    # nobody waited for the server's timeout: all were open together at once
    assert max(r.ttft for r in results) < WAIT_S


def test_closed_loop_concurrency_is_not_capped_by_the_client() -> None:
    gated, results = asyncio.run(_serve("closed"))
    assert gated.most_open == OPEN
    assert all(r.error is None for r in results)
