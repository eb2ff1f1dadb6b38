"""HTTP surface of the router (aiohttp on uvloop): SGLang's endpoints plus admin and metrics.

Worker answers relayed on the info routes (``/v1/models``, ``/model_info``, ``/get_model_info``,
``/server_info``, ``/get_server_info``, ``/health_generate``) are read under the control-answer
cap (``control.py``) and redacted for the caller's view (``redact.py``; a body that is not JSON
is not relayed). An answer that is not usable (over the cap, not JSON, a 5xx) sends the route
on to the next worker, each worker asked at most once; 502 only when none gives one. In PD
mode ``/health_generate`` asks one prefill and one decode worker: 200 only if both sides
answer it. ``/health_generate`` is open and makes workers generate, so one probe at a time
serves every caller, and its outcome is reused for ``HEALTH_GENERATE_TTL_S``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from omniinfer.proxy import worker_api
from omniinfer.proxy.auth import AccessControl, error_response, full_view, json_errors
from omniinfer.proxy.config import RouterConfig
from omniinfer.proxy.control import AnswerTooLarge, read_capped
from omniinfer.proxy.core import Router
from omniinfer.proxy.cors import Cors
from omniinfer.proxy.forward import handle
from omniinfer.proxy.listener import Listener
from omniinfer.proxy.redact import redact
from omniinfer.proxy.tls import server_context
from omniinfer.proxy.workers import Role, Worker, normalize_url

log = logging.getLogger("omniinfer.proxy")
# /metrics also on this port unless --prometheus-port says otherwise (0: not), as sglang-router
# and smg serve it; when the default port is taken, or a key is configured (that listener asks
# for none), the router starts without it
DEFAULT_METRICS_PORT = 29000
ROUTER_KEY = web.AppKey("router", Router)
MAX_ADMIN_BODY = 64 * 1024
KEEPALIVE_S = 75.0
INFO_TIMEOUT_S = 10.0
# after the drain (the grace period is its) only short calls can remain on a connection
SHUTDOWN_TIMEOUT_S = 5.0
HEALTH_GENERATE_TTL_S = 1.0  # how long one /health_generate probe answers every caller
WORKER_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(data), content_type="application/json")


def _router(request: web.Request) -> Router:
    return request.app[ROUTER_KEY]


def _inference(endpoint: str) -> Any:
    async def route(request: web.Request) -> web.StreamResponse:
        return await handle(_router(request), request, endpoint)

    return route


async def _fetch(router: Router, worker: Worker, path: str) -> tuple[int, bytes]:
    """GET ``path`` from ``worker``: (status, body) under the control cap; raises
    ``AnswerTooLarge`` or a transport error."""
    assert router.session is not None
    async with router.session.get(worker.url + path, headers=router.control_headers,
                                  timeout=aiohttp.ClientTimeout(total=INFO_TIMEOUT_S)) as resp:
        return resp.status, await read_capped(resp, router.control_cap)


@dataclasses.dataclass(frozen=True, slots=True)
class Relay:
    """An info route's outcome: a worker's usable answer (``status``; ``data`` decoded, unless
    ``empty``), or with ``error`` the status and message of the reason none was usable."""

    status: int
    data: Any = None
    empty: bool = False
    error: str | None = None


def _decoded(status: int, body: bytes) -> Relay:
    """A usable answer: below 500, and JSON or empty; anything else is an error (a worker's
    own error text may name anything: it is not relayed)."""
    if not body.strip():
        return Relay(status, empty=True) if status < 500 else \
            Relay(502, error=f"the worker answered HTTP {status}")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        data = None
    if data is None or status >= 500:
        return Relay(status if 400 <= status < 500 else 502,
                     error=f"the worker answered HTTP {status}"
                     + ("" if data is not None else " with a body that is not JSON"))
    return Relay(status, data)


def _relayed(request: web.Request, relay: Relay) -> web.Response:
    """A relay as the caller may read it: JSON, redacted for its view; or the JSON error."""
    if relay.error is not None:
        unavailable = relay.status == 503
        return error_response(relay.status, relay.error,
                              "unavailable" if unavailable else "upstream_error",
                              retry_after=1 if unavailable else None)
    if relay.empty:
        return web.Response(status=relay.status, body=b"", content_type="application/json")
    return _json(redact(relay.data, strict=not full_view(request)), status=relay.status)


def _info_workers(router: Router, role: Role) -> list[Worker]:
    return router.pool.candidates(role, asyncio.get_running_loop().time()) or \
        router.pool.role(role)


async def _ask(router: Router, path: str) -> Relay:
    """GET ``path`` from the decode/regular workers (the available ones first), each at most
    once under ``INFO_TIMEOUT_S``, until one gives a usable answer. None usable: the last
    refusal (over the cap, not JSON, a 5xx: 502), or 503 when no worker answered at all."""
    refused: Relay | None = None
    for worker in _info_workers(router, Role.DECODE if router.pd else Role.REGULAR):
        try:
            status, body = await _fetch(router, worker, path)
        except AnswerTooLarge:
            refused = Relay(502, error="the worker's answer is larger than the router relays")
            continue
        except WORKER_ERRORS:
            continue
        relay = _decoded(status, body)
        if relay.error is None:
            return relay
        refused = relay
    return refused or Relay(503, error="no worker answered")


async def _from_worker(request: web.Request, path: str) -> web.Response:
    """GET ``path`` from the first decode/regular worker with a usable answer; relay it."""
    return _relayed(request, await _ask(_router(request), path))


async def models(request: web.Request) -> web.Response:
    return await _from_worker(request, "/v1/models")


async def model_info(request: web.Request) -> web.Response:
    return await _from_worker(request, "/model_info")


async def _generates(router: Router, role: Role) -> bool:
    """Whether a worker of ``role`` (the available ones first) answers /health_generate 200."""
    for worker in _info_workers(router, role):
        try:
            status, _ = await _fetch(router, worker, "/health_generate")
        except WORKER_ERRORS:
            continue
        if status == 200:
            return True
    return False


async def _probe_generation(router: Router) -> Relay:
    """Regular mode: a worker's /health_generate answer. PD mode: 200 if a prefill worker and
    a decode worker both answer theirs with 200 (asked at once), else 503 naming the side."""
    if not router.pd:
        return await _ask(router, "/health_generate")
    prefill, decode = await asyncio.gather(_generates(router, Role.PREFILL),
                                           _generates(router, Role.DECODE))
    if prefill and decode:
        return Relay(200, {"status": "ok"})
    missing = " and ".join(role for role, ok in (("prefill", prefill), ("decode", decode))
                           if not ok)
    return Relay(503, error=f"no {missing} worker answered /health_generate")


class Shared:
    """Single flight with a short memory: at most one call of the probe runs at a time, every
    caller meanwhile awaits that one, and its outcome answers callers for ``ttl`` seconds
    after it ends. A caller that goes away does not cancel the probe (others wait on it)."""

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self._task: asyncio.Task[Relay] | None = None
        self._ended = 0.0

    async def get(self, probe: Callable[[], Awaitable[Relay]]) -> Relay:
        loop = asyncio.get_running_loop()
        task = self._task
        if task is None or (task.done() and loop.time() - self._ended >= self.ttl):
            task = self._task = loop.create_task(self._run(probe))
        return await asyncio.shield(task)

    async def _run(self, probe: Callable[[], Awaitable[Relay]]) -> Relay:
        try:
            return await probe()
        finally:
            self._ended = asyncio.get_running_loop().time()


HEALTH_KEY = web.AppKey("health_generate", Shared)


async def health_generate(request: web.Request) -> web.Response:
    """An open route that makes workers generate: one probe (``_probe_generation``) at a time
    for all callers, its outcome shared for ``HEALTH_GENERATE_TTL_S`` (so a flood of anonymous
    calls costs the workers at most one generation per side each such period), then redacted
    for each caller's view."""
    router = _router(request)
    relay = await request.app[HEALTH_KEY].get(lambda: _probe_generation(router))
    return _relayed(request, relay)


async def server_info(request: web.Request) -> web.Response:
    """The first decode/regular worker's /server_info and the router's own state, redacted for
    the caller's view at any depth (SGLang repeats its server args, keys included, in
    ``internal_states``): a user key reads no member named like a key, secret, password or
    token, neither the worker's nor the router's (``omniproxy``); the full view (admin) gets
    the router's block whole."""
    router = _router(request)
    role = Role.DECODE if router.pd else Role.REGULAR
    info: Any = None
    for worker in router.pool.role(role):
        info = await router.get_json(worker, "/server_info", timeout=INFO_TIMEOUT_S)
        if isinstance(info, dict):
            break
    strict = not full_view(request)
    data = redact(info, strict) if isinstance(info, dict) else {}
    own = router.describe()  # the router's state holds no worker secret: only a user key's
    data["omniproxy"] = redact(own, strict) if strict else own  # view trims its names
    return _json(data)


async def health(request: web.Request) -> web.Response:
    router = _router(request)
    if router.drain.draining:  # a load balancer should look elsewhere while in flight ones end
        return _json({"status": "shutting down"}, status=503)
    if router.ready():
        return _json({"status": "ok"})
    return _json({"status": "no healthy worker for every role"}, status=503)


async def liveness(request: web.Request) -> web.Response:
    return _json({"status": "alive"})


async def metrics(request: web.Request) -> web.Response:
    router = _router(request)
    router.metrics.admission_active.set(router.admission.active)
    router.metrics.admission_queued.set(router.admission.queued)
    return web.Response(body=router.metrics.render(),
                        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def _expect(request: web.Request) -> None:
    """``Expect: 100-continue`` is answered as aiohttp does; any other expectation gets a JSON
    417 (aiohttp's own is plain text and never reaches the JSON middleware)."""
    expect = request.headers.get("Expect", "")
    if request.version != aiohttp.HttpVersion11:
        return
    if expect.lower() != "100-continue":
        raise web.HTTPExpectationFailed(body=orjson.dumps({"error": {
            "message": "only 'Expect: 100-continue' is supported",
            "type": "invalid_request_error", "code": 417}}), content_type="application/json")
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    request.writer.output_size = 0  # the answer proper has not started


def build_app(router: Router) -> web.Application:
    c = router.config
    access = AccessControl(c.api_key, c.control_plane_api_keys, c.control_plane_audit_enabled)
    app = web.Application(client_max_size=c.max_payload_size,
                          middlewares=[json_errors, access.middleware])
    app[ROUTER_KEY] = router
    app[HEALTH_KEY] = Shared(HEALTH_GENERATE_TTL_S)
    if c.cors_allowed_origins:
        Cors(c.cors_allowed_origins).install(app)
    posts = {"/generate": _inference("generate"), "/v1/completions": _inference("completions"),
             "/v1/chat/completions": _inference("chat")}
    gets = {"/v1/models": models, "/model_info": model_info, "/get_model_info": model_info,
            "/server_info": server_info, "/get_server_info": server_info, "/health": health,
            "/readiness": health, "/liveness": liveness, "/health_generate": health_generate,
            "/metrics": metrics}
    for path, route in posts.items():
        app.router.add_post(path, route, expect_handler=_expect)
    for path, route in gets.items():
        app.router.add_get(path, route, expect_handler=_expect)
    worker_api.add_routes(app, router, _expect)
    return app


class Serving:
    """A started router and its listening sockets: what ``serve`` runs until a signal, and what
    an in-process benchmark or test drives from its own event loop."""

    def __init__(self, router: Router, runner: web.AppRunner, listener: Listener,
                 extra: web.AppRunner | None) -> None:
        self.router, self.runner, self.listener, self.extra = router, runner, listener, extra

    async def drain(self, grace_s: float, hurry: asyncio.Event | None = None) -> int:
        """Graceful shutdown's first half (``drain.py``): stop accepting connections, let the
        requests in flight end within ``grace_s`` (``hurry`` set: at once), cut the rest with
        one terminal answer each. Returns how many were cut; ``close`` follows."""
        self.listener.stop_accepting()
        return await self.router.drain.run(grace_s, hurry)

    async def close(self) -> None:
        self.listener.stop_accepting()
        await self.runner.cleanup()  # closes the open connections
        await self.listener.close()  # on Python >= 3.12 this waits for them
        if self.extra is not None:
            await self.extra.cleanup()
        await self.router.close()


async def open_router(config: RouterConfig) -> Serving:
    """Start the router on the running loop and listen on ``config.host:config.port``."""
    router = Router(config)
    await router.start()
    gc.collect()
    gc.freeze()  # what start-up built lives as long as the router: no collection rescans it
    # idle kept-alive client connections close after 75 s (aiohttp's and nginx's default), well
    # past the keep-alive clients assume (aiohttp's client 15 s, httpx 5 s): a shorter one races
    # a client reusing the connection as it closes (its POST body cannot be written)
    runner = web.AppRunner(build_app(router), handler_cancellation=True, access_log=None,
                           keepalive_timeout=max(KEEPALIVE_S, config.client_header_timeout_secs),
                           shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    await runner.setup()
    assert runner.server is not None
    listener = Listener(runner.server, config.max_connections, config.client_header_timeout_secs,
                        config.client_write_timeout_secs)
    router.serve_on(listener)
    await listener.start(config.host, config.port,
                         tls=server_context(config.tls_cert_path, config.tls_key_path))
    extra = None
    port = DEFAULT_METRICS_PORT if config.prometheus_port is None else config.prometheus_port
    if config.prometheus_port is None and (config.api_key or config.control_plane_api_keys):
        # /metrics names the workers and asks for a key on the main port; the extra listener
        # is open, so it opens only when asked for (--prometheus-port)
        log.info("a key is configured: /metrics on the main port only (give --prometheus-port "
                 "for an open metrics listener)")
        port = 0
    if port:
        metrics_app = web.Application(middlewares=[json_errors])
        metrics_app[ROUTER_KEY] = router
        metrics_app.router.add_get("/metrics", metrics, expect_handler=_expect)
        extra = web.AppRunner(metrics_app, access_log=None)
        await extra.setup()
        try:
            await web.TCPSite(extra, config.prometheus_host or config.host, port).start()
        except OSError as exc:
            await extra.cleanup()
            extra = None
            if config.prometheus_port is not None:  # asked for: a usage error
                await listener.close()
                await runner.cleanup()
                await router.close()
                raise
            log.warning("metrics port %d not available (%s): /metrics is served on the main "
                        "port only", port, exc.strerror or exc)
    return Serving(router, runner, listener, extra)


async def _serve(config: RouterConfig) -> None:
    serving = await open_router(config)
    router = serving.router
    stop, hurry = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()

    def signalled() -> None:  # the first signal drains, a second one cuts at once
        (hurry if stop.is_set() else stop).set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, signalled)
    workers = ", ".join(f"{w.role.value} {w.url}{' (down)' if not w.healthy else ''}"
                        for w in router.pool.all())
    log.info("OmniProxy listening on %s://%s:%d (%s mode; policies %s; workers: %s)",
             "https" if config.tls_cert_path else "http", config.host, config.port, "PD" if router.pd else "regular",
             {r.value: p.name for r, p in router.policies.items()}, workers)
    await stop.wait()
    grace = config.shutdown_grace_period_secs
    log.info("shutting down: no new connections; %d request(s) in flight get %.0f s to end",
             router.drain.in_flight, grace)
    cut = await serving.drain(grace, hurry)
    log.info("shut down (%d request(s) cut)", cut)
    await serving.close()


def serve(config: RouterConfig) -> int:
    try:  # a bad worker URL is a usage error (exit 2), not a traceback
        for url in [*config.worker_urls, *(u for u, _ in config.prefill_urls),
                    *config.decode_urls]:
            normalize_url(url)
    except ValueError as exc:
        print(f"omniinfer router: error: {exc}", file=sys.stderr)
        return 2
    level = {"warn": logging.WARNING}.get(config.log_level, config.log_level.upper())
    form = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=level, stream=sys.stderr, format=form)
    if config.log_dir:
        try:
            Path(config.log_dir).mkdir(parents=True, exist_ok=True)
            handler = logging.FileHandler(Path(config.log_dir) / "omniproxy.log")
        except OSError as exc:
            print(f"omniinfer router: error: --log-dir {config.log_dir}: {exc}", file=sys.stderr)
            return 2
        handler.setFormatter(logging.Formatter(form))
        logging.getLogger().addHandler(handler)
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # uvloop is optional; asyncio's loop also works
        runner = asyncio.run
    try:
        runner(_serve(config))
    except OSError as exc:
        print(f"omniinfer router: error: {exc}", file=sys.stderr)
        return 1
    return 0
