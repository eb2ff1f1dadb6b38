"""An in-process router (``open_router``) in front of scripted aiohttp workers, for tests that
need exact control of what a worker answers and what a client sends, byte by byte."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer

from omniinfer.child_process import free_port
from omniinfer.proxy.config import RouterConfig
from omniinfer.proxy.server import Serving, open_router

Route = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def _ok(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _no_loads(request: web.Request) -> web.Response:
    return web.json_response({"error": "none"}, status=404)


class ScriptedWorker:
    """An aiohttp app speaking enough of SGLang's API; ``routes`` override or add paths. Every
    request it receives is recorded as (method, path, headers, body)."""

    def __init__(self, routes: dict[str, Route] | None = None) -> None:
        self.seen: list[tuple[str, str, dict[str, str], bytes]] = []
        self.routes = {"/health": _ok, "/v1/loads": _no_loads, "/abort_request": _ok,
                       **(routes or {})}
        self.server: TestServer | None = None

    @web.middleware
    async def _record(self, request: web.Request, handler: Any) -> web.StreamResponse:
        body = await request.read()
        self.seen.append((request.method, request.path, dict(request.headers), body))
        return await handler(request)

    async def start(self) -> str:
        app = web.Application(middlewares=[self._record], client_max_size=1 << 30)
        for path, route in self.routes.items():
            app.router.add_route("*", path, route)
        self.server = TestServer(app, host="127.0.0.1")
        await self.server.start_server()
        return f"http://127.0.0.1:{self.server.port}"

    def paths(self) -> list[str]:
        return [path for _, path, _, _ in self.seen]

    async def close(self) -> None:
        if self.server is not None:
            await self.server.close()


@contextlib.asynccontextmanager
async def router_for(workers: list[ScriptedWorker], **config: Any
                     ) -> AsyncIterator[tuple[str, Serving]]:
    """Start the workers and a router over them; yields (router base URL, serving). ``config``
    overrides any setting, the test defaults (no polling, no health checks) included."""
    urls = [await w.start() for w in workers]
    port = free_port()
    settings: dict[str, Any] = {"worker_urls": urls, "host": "127.0.0.1", "port": port,
                                "loads_poll_interval_secs": 0, "disable_health_check": True,
                                "retry_initial_backoff_ms": 1, **config}
    serving = await open_router(RouterConfig(**settings))
    try:
        yield f"http://127.0.0.1:{port}", serving
    finally:
        await serving.close()
        for w in workers:
            await w.close()


async def raw_exchange(port: int, data: bytes, timeout: float = 10.0,
                       pause_after: int | None = None, pause_s: float = 0.0) -> bytes:
    """Send ``data`` on a fresh connection (optionally pausing after ``pause_after`` bytes) and
    read until the router closes it or ``timeout`` passes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        if pause_after is None:
            writer.write(data)
        else:
            writer.write(data[:pause_after])
            await writer.drain()
            await asyncio.sleep(pause_s)
            writer.write(data[pause_after:])
        await writer.drain()
        out = b""
        with contextlib.suppress(TimeoutError, ConnectionError):
            async with asyncio.timeout(timeout):
                while chunk := await reader.read(65536):
                    out += chunk
        return out
    finally:
        writer.close()
