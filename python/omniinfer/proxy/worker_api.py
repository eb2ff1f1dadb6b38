"""The worker-management routes: sglang-router's (``/add_worker``, ``/remove_worker``,
``/list_workers``, ``/flush_cache``) and smg 1.13's REST API beside them, under the same admin rules (``auth.py``).

smg's API, as its scripts use it:

- ``POST /workers`` ``{"url", "worker_type": regular|prefill|decode, "bootstrap_port"?,
  "labels"?, "priority"?, "cost"?, ...}`` → 202 ``{"status": "accepted", "worker_id", "url",
  "location"}`` with a ``Location`` header. Registration runs in the background, as smg's job
  queue does: the worker's health check is tried up to ``max_connection_attempts`` times (default
  20, at most 120), one second apart, so a worker may be registered while it is still loading.
  ``GET /workers/{id}`` says ``job_status`` meanwhile (``pending``, then ``failed`` with the
  reason, or the worker). 409 ``WORKER_ALREADY_EXISTS`` for a URL already registered or pending.
- ``GET /workers[?model=]`` → ``{"workers": [...], "total", "stats": {"prefill_count",
  "decode_count", "regular_count"}}``; ``GET /workers/{id}`` → one, or 404 ``WORKER_NOT_FOUND``.
- ``DELETE /workers/{id}`` → 202, the worker removed; ``PATCH /workers/{id}`` ``{"labels",
  "priority", "cost"}`` → 202, kept as the worker's metadata (OmniProxy's policies do not read
  them); ``PUT /workers/{id}`` (same URL) → 202, the worker registered again from the new spec.

A worker's id is a UUID derived from its canonical URL (UUID 5), so it is the same on every
router and after a restart. What OmniProxy cannot honour is refused with 400 ``BAD_REQUEST``
naming the field: a per-worker ``api_key`` (the router sends ``--api-key`` to every worker),
``connection_mode: grpc``, a ``runtime_type`` other than sglang, per-worker ``health``,
``http_pool`` and ``resilience`` overrides. Bodies are at most 64 KiB, read within
``--client-body-timeout-secs``; at most 256 registrations are pending or remembered as failed.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import uuid
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from omniinfer.proxy.auth import error_response
from omniinfer.proxy.control import read_capped
from omniinfer.proxy.core import Router
from omniinfer.proxy.workers import Role, Worker, normalize_url

log = logging.getLogger("omniinfer.proxy")
MAX_ADMIN_BODY = 64 * 1024
MAX_JOBS = 256
RETRY_S = 1.0
REFUSED_FIELDS = {
    "api_key": "a per-worker API key is not supported: the router sends --api-key to every worker",
    "health": "per-worker health-check settings are not supported (--health-check-* apply)",
    "http_pool": "per-worker connection-pool settings are not supported",
    "resilience": "per-worker retry and circuit-breaker settings are not supported",
}
METADATA = ("labels", "priority", "cost", "models")
INERT_FIELDS = frozenset({"url", "worker_type", "bootstrap_port", "connection_mode", "runtime",
                          "runtime_type", "max_connection_attempts", "provider", "dp_size",
                          "kv_connector", "kv_role", "kv_block_size", "load_monitor_interval_secs",
                          "role", *METADATA})


def worker_id(url: str) -> str:
    return str(uuid.uuid5(uuid.NAMESPACE_URL, url))


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(data), headers=headers,
                        content_type="application/json")


def _smg_error(status: int, code: str, message: str) -> web.Response:
    return _json({"error": message, "code": code}, status=status)


async def read_args(router: Router, request: web.Request, query: bool = True) -> dict[str, Any]:
    """Fields from the query string (sglang_router style, when ``query``) and a JSON object
    body: at most ``MAX_ADMIN_BODY`` bytes, read within the body timeout; ValueError if not."""
    args: dict[str, Any] = dict(request.query) if query else {}
    if request.can_read_body:
        if (request.content_length or 0) > MAX_ADMIN_BODY:
            raise ValueError(f"admin bodies are at most {MAX_ADMIN_BODY} bytes")
        raw = bytearray()
        try:
            async with asyncio.timeout(router.config.client_body_timeout_secs):
                while chunk := await request.content.readany():  # every chunk, to the end
                    raw += chunk
                    if len(raw) > MAX_ADMIN_BODY:
                        raise ValueError(f"admin bodies are at most {MAX_ADMIN_BODY} bytes")
        except TimeoutError:
            raise ValueError("body not received in time") from None
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise ValueError("body is not valid JSON") from None
        if not isinstance(body, dict):
            raise ValueError("body must be a JSON object")
        args.update(body)
    return args


def parse_spec(router: Router, args: dict[str, Any]) -> tuple[str, Role, int | None]:
    """(canonical URL, role, bootstrap port) of a worker spec; ValueError naming the field."""
    url = args.get("url")
    if not isinstance(url, str) or not url:
        raise ValueError("'url' is required")
    url = normalize_url(url)
    kind = args.get("worker_type", args.get("role"))
    if kind is None and router.pd:
        raise ValueError("PD mode: 'worker_type' must be 'prefill' or 'decode'")
    try:
        role = Role.REGULAR if kind is None else Role(kind)
    except ValueError:
        raise ValueError("'worker_type' must be regular, prefill or decode") from None
    if role not in router.roles():
        raise ValueError(f"'worker_type' {role.value!r} is not served in "
                         f"{'PD' if router.pd else 'regular'} mode")
    port = args.get("bootstrap_port")
    if isinstance(port, str):
        port = None if port.lower() in ("", "none") else int(port) if port.isdigit() else -1
    if port is not None and (not isinstance(port, int) or isinstance(port, bool)
                             or not 0 < port < 65536):
        raise ValueError("'bootstrap_port' must be a port number (1-65535) or none")
    return url, role, port


def _check_smg_spec(args: dict[str, Any]) -> None:
    for name, reason in REFUSED_FIELDS.items():
        if args.get(name) not in (None, {}, ""):
            raise ValueError(f"'{name}': {reason}")
    if args.get("connection_mode", "http") != "http":
        raise ValueError("'connection_mode': only http workers are supported")
    runtime = args.get("runtime_type", args.get("runtime", "sglang"))
    if runtime != "sglang":
        raise ValueError("'runtime_type': only sglang workers are supported")
    unknown = sorted(set(args) - INERT_FIELDS - set(REFUSED_FIELDS))
    if unknown:
        raise ValueError(f"unknown field(s): {', '.join(map(str, unknown[:8]))}")
    labels = args.get("labels", {})
    if not isinstance(labels, dict) or len(labels) > 64 or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 256 and len(v) <= 1024
            for k, v in labels.items()):
        raise ValueError("'labels' must be an object of at most 64 short strings")
    models = args.get("models", [])
    if not isinstance(models, list) or len(models) > 64 or not all(
            isinstance(m, str) and len(m) <= 256 for m in models):
        raise ValueError("'models' must be a list of at most 64 model names")
    for name in ("priority", "cost"):
        value = args.get(name, 0)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= 1e9:
            raise ValueError(f"'{name}' must be a number within [0, 1e9]")


class Registrations:
    """smg-style registrations in flight or failed, by worker id (at most ``MAX_JOBS``)."""

    def __init__(self) -> None:
        self.jobs: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()
        self.metadata: dict[str, dict[str, Any]] = {}  # worker id -> labels, priority, cost

    def pending(self, wid: str) -> bool:
        job = self.jobs.get(wid)
        return job is not None and job["job_status"] == "pending"

    def room(self) -> None:
        """ValueError when no further registration may start (``MAX_JOBS`` pending)."""
        if sum(j["job_status"] == "pending" for j in self.jobs.values()) >= MAX_JOBS:
            raise ValueError(f"at most {MAX_JOBS} registrations may be pending")

    def start(self, router: Router, wid: str, url: str, role: Role, port: int | None,
              attempts: int, metadata: dict[str, Any]) -> None:
        self.room()
        self.jobs[wid] = {"id": wid, "url": url, "worker_type": role.value,
                          "job_status": "pending", "attempts": 0}
        self.jobs.move_to_end(wid)
        for old in [k for k, j in self.jobs.items() if j["job_status"] != "pending"]:
            if len(self.jobs) <= MAX_JOBS:
                break
            del self.jobs[old]  # the oldest failed ones go; a pending one stays
        self.metadata[wid] = metadata
        router.spawn(self._register(router, wid, url, role, port, attempts),
                     "worker-registration")

    async def _register(self, router: Router, wid: str, url: str, role: Role,
                        port: int | None, attempts: int) -> None:
        job = self.jobs.get(wid, {})
        error = "not tried"
        for attempt in range(attempts):
            job["attempts"] = attempt + 1
            try:
                await router.add_worker(url, role, port)
            except ValueError as exc:
                error = str(exc)
                if "already registered" in error or "not served" in error:
                    break
                await asyncio.sleep(RETRY_S)
                continue
            except Exception as exc:  # anything else ends the job as failed, never pending
                error = f"{type(exc).__name__}: {exc}"
                break
            self.jobs.pop(wid, None)
            log.info("worker %s registered through POST /workers", url)
            return
        job.update(job_status="failed", error=error)
        self.metadata.pop(wid, None)
        log.warning("worker %s not registered: %s", url, error)


def info(router: Router, worker: Worker, registrations: Registrations) -> dict[str, Any]:
    wid = worker_id(worker.url)
    return {"id": wid, **worker.describe(), "worker_type": worker.role.value,
            "is_healthy": worker.healthy, **registrations.metadata.get(wid, {})}


def _find(router: Router, wid: str) -> Worker | None:
    for worker in router.pool.all():
        if worker_id(worker.url) == wid:
            return worker
    return None


async def flush_caches(router: Router) -> dict[str, int | str]:
    """``POST /flush_cache`` on every worker (30 s each, answers capped); the router forgets
    the cached blocks of each worker that flushed. Status or error per worker URL."""
    assert router.session is not None
    session = router.session

    async def one(worker: Worker) -> int | str:
        try:
            async with session.post(worker.url + "/flush_cache", headers=router.control_headers,
                                    timeout=aiohttp.ClientTimeout(total=30.0)) as resp:
                await read_capped(resp, router.control_cap)
                return resp.status
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            return f"error: {exc.__class__.__name__}"

    workers = router.pool.all()
    results = await asyncio.gather(*(one(w) for w in workers))
    for worker, status in zip(workers, results, strict=True):
        if status == 200:
            router.indexes[worker.role].clear(worker.url)
            router.cache_truth.forget(worker)
    return {w.url: s for w, s in zip(workers, results, strict=True)}


def add_routes(app: web.Application, router: Router, expect: Any = None) -> None:
    """Both APIs on ``app``, bound to ``router`` (``expect``: the ``Expect`` header handler)."""
    registrations = Registrations()

    async def add_worker(request: web.Request) -> web.Response:
        try:
            url, role, port = parse_spec(router, await read_args(router, request))
            worker = await router.add_worker(url, role, port)
        except ValueError as exc:
            return error_response(400, str(exc))
        return _json({"added": worker.describe()})

    async def remove_worker(request: web.Request) -> web.Response:
        try:
            url = (await read_args(router, request)).get("url")
            if not isinstance(url, str) or not url:
                raise ValueError("'url' is required")
            worker = router.remove_worker(url)
        except ValueError as exc:
            return error_response(400, str(exc))
        except KeyError:
            return error_response(404, f"no such worker: {url}")
        registrations.metadata.pop(worker_id(worker.url), None)
        return _json({"removed": worker.url})

    async def list_workers(request: web.Request) -> web.Response:
        return _json(router.describe())

    async def flush_cache(request: web.Request) -> web.Response:
        results = await flush_caches(router)
        ok = all(status == 200 for status in results.values())
        return _json({"success": ok, "workers": results}, status=200 if ok else 502)

    async def smg_spec(request: web.Request) -> tuple[dict[str, Any], str, Role, int | None]:
        args = await read_args(router, request, query=False)
        _check_smg_spec(args)
        url, role, port = parse_spec(router, args)
        return args, url, role, port

    def attempts_of(args: dict[str, Any]) -> int:
        attempts = args.get("max_connection_attempts", 20)
        if not isinstance(attempts, int) or isinstance(attempts, bool) or not 1 <= attempts <= 120:
            raise ValueError("'max_connection_attempts' must be within [1, 120]")
        return attempts

    def register(args: dict[str, Any], url: str, role: Role, port: int | None,
                 status: str) -> web.Response:
        wid = worker_id(url)
        attempts = attempts_of(args)
        registrations.start(router, wid, url, role, port, attempts,
                            {k: args[k] for k in METADATA if k in args})
        location = f"/workers/{wid}"
        return _json({"status": status, "worker_id": wid, "url": url, "location": location,
                      "message": "worker registration queued"}, status=202,
                     headers={"Location": location})

    async def create(request: web.Request) -> web.Response:
        try:
            args, url, role, port = await smg_spec(request)
            wid = worker_id(url)
            if router.pool.get(url) is not None or registrations.pending(wid):
                return _smg_error(409, "WORKER_ALREADY_EXISTS", f"Worker already exists at URL "
                                  f"'{url}' with ID {wid}. Use PUT /workers/{wid} to replace or "
                                  f"PATCH /workers/{wid} to update.")
            return register(args, url, role, port, "accepted")
        except ValueError as exc:
            return _smg_error(400, "BAD_REQUEST", str(exc))

    async def listing(request: web.Request) -> web.Response:
        model = request.query.get("model")
        workers = [info(router, w, registrations) for w in router.pool.all()]
        if model is not None:
            workers = [w for w in workers if not w.get("models") or model in w["models"]]
        counts = collections.Counter(w["worker_type"] for w in workers)
        return _json({"workers": workers, "total": len(workers), "stats": {
            "prefill_count": counts["prefill"], "decode_count": counts["decode"],
            "regular_count": counts["regular"]}})

    def lookup(request: web.Request) -> tuple[str, Worker | None, web.Response | None]:
        raw = request.match_info["worker_id"]
        try:
            wid = str(uuid.UUID(raw))
        except ValueError:
            return raw, None, _smg_error(400, "BAD_REQUEST",
                                         f"Invalid worker_id '{raw[:64]}' (expected UUID)")
        worker = _find(router, wid)
        if worker is None and wid not in registrations.jobs:
            return wid, None, _smg_error(404, "WORKER_NOT_FOUND", f"Worker {wid} not found")
        return wid, worker, None

    async def get_one(request: web.Request) -> web.Response:
        wid, worker, missing = lookup(request)
        if missing is not None:
            return missing
        if worker is None:
            return _json(registrations.jobs[wid])
        return _json(info(router, worker, registrations))

    async def delete(request: web.Request) -> web.Response:
        wid, worker, missing = lookup(request)
        if missing is not None:
            return missing
        if worker is None:
            return _smg_error(409, "BAD_REQUEST", f"Worker {wid} is still being registered")
        router.remove_worker(worker.url)
        registrations.metadata.pop(wid, None)
        return _json({"status": "accepted", "worker_id": wid, "url": worker.url,
                      "message": "worker removed"}, status=202)

    async def patch(request: web.Request) -> web.Response:
        wid, worker, missing = lookup(request)
        if missing is not None:
            return missing
        try:
            update = await read_args(router, request, query=False)
            _check_smg_spec({"url": "", **update})
            if set(update) - set(METADATA):
                raise ValueError(f"PATCH may change {', '.join(METADATA)} only")
        except ValueError as exc:
            return _smg_error(400, "BAD_REQUEST", str(exc))
        registrations.metadata.setdefault(wid, {}).update(update)
        return _json({"status": "accepted", "worker_id": wid, "message": "worker updated"},
                     status=202)

    async def replace(request: web.Request) -> web.Response:
        wid, worker, missing = lookup(request)
        if missing is not None:
            return missing
        try:
            args, url, role, port = await smg_spec(request)
            if worker is None or url != worker.url:
                raise ValueError("URL mismatch: PUT keeps the worker's URL; use DELETE + POST")
            attempts_of(args)  # every check before the worker is removed
            registrations.room()
            router.remove_worker(worker.url)
            return register(args, url, role, port, "accepted")
        except ValueError as exc:
            return _smg_error(400, "BAD_REQUEST", str(exc))

    for method, path, handler in (
            ("POST", "/add_worker", add_worker), ("POST", "/remove_worker", remove_worker),
            ("GET", "/list_workers", list_workers), ("POST", "/flush_cache", flush_cache),
            ("POST", "/workers", create),
            ("GET", "/workers", listing), ("GET", "/workers/{worker_id}", get_one),
            ("DELETE", "/workers/{worker_id}", delete), ("PATCH", "/workers/{worker_id}", patch),
            ("PUT", "/workers/{worker_id}", replace)):
        app.router.add_route(method, path, handler, expect_handler=expect)
