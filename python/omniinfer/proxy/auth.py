"""Who may call the router, and every error as JSON.

Flags as ``sglang_router.launch_router`` reads them: ``--api-key`` is sent to workers as
``Authorization: Bearer KEY`` and, as SGLang's own server does, required of clients on every
route but health and metrics. ``--control-plane-api-keys 'id:name:role:key'`` (role ``admin`` or
``user``) adds named keys: ``admin`` may call the admin routes (``/add_worker``,
``/remove_worker``, ``/flush_cache``, ``/list_workers`` and smg's ``/workers`` API, whose GETs
read and other methods mutate), both may call the data plane.
Once any control-plane key exists, the admin routes answer admin keys only, from anywhere
(loopback included: behind a reverse proxy on the same host every client is loopback). With no
control-plane key, the mutating admin routes answer loopback clients only (with ``--api-key``
when one is set), so a router started with no flags cannot be reconfigured from the network.
``/metrics`` names the workers: it asks for a key whenever one is configured (the
``--prometheus-port`` listener stays open; bind it where scrapers are). ``--control-plane-audit-
enabled`` logs one line per admin call (who, role, method, path, outcome).

Worker info relayed to a client is redacted (``redact.py``): each request carries
``FULL_VIEW``, true for who may read ``/list_workers`` (an admin key; anyone when no key is
configured), false otherwise (a user key, ``--api-key``, an open route's anonymous caller).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
from collections.abc import Awaitable, Callable

import orjson
from aiohttp import web

from omniinfer.net import is_loopback

audit_log = logging.getLogger("omniinfer.proxy.audit")
log = logging.getLogger("omniinfer.proxy")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

OPEN_PATHS = frozenset({"/health", "/readiness", "/liveness", "/health_generate"})
ADMIN_MUTATING = frozenset({"/add_worker", "/remove_worker", "/flush_cache"})
ADMIN_READ = frozenset({"/list_workers"})
WORKERS = "/workers"  # smg's worker API: GET reads, every other method mutates


def admin_kind(method: str, path: str) -> str | None:
    """``"mutating"``, ``"read"`` or None (not an admin route) for a request."""
    if path in ADMIN_MUTATING:
        return "mutating"
    if path in ADMIN_READ:
        return "read"
    if path == WORKERS or path.startswith(WORKERS + "/"):
        return "read" if method in ("GET", "HEAD") else "mutating"
    return None
FULL_VIEW = web.RequestKey("omniproxy_full_view", bool)


def full_view(request: web.Request) -> bool:
    """Whether the caller gets the full (admin) view of worker info; False when unset."""
    return bool(request.get(FULL_VIEW, False))


def error_response(status: int, message: str, kind: str = "invalid_request_error",
                   retry_after: int | None = None) -> web.Response:
    """SGLang/OpenAI-shaped error body, always JSON."""
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    body = {"error": {"message": message, "type": kind, "code": status}}
    return web.Response(status=status, body=orjson.dumps(body), headers=headers,
                        content_type="application/json")


@dataclasses.dataclass(frozen=True)
class Principal:
    key_id: str
    name: str
    role: str  # "admin" | "user"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def parse_control_plane_keys(entries: list[str]) -> dict[bytes, Principal]:
    """``id:name:role:key`` entries by the SHA-256 of the key (the key itself is not kept)."""
    out: dict[bytes, Principal] = {}
    for entry in entries:
        parts = entry.split(":", 3)
        if len(parts) != 4 or not all(parts) or parts[2] not in ("admin", "user"):
            raise ValueError("--control-plane-api-keys takes 'id:name:role:key' with role "
                             f"admin or user; got {entry.split(':', 1)[0]!r}...")
        out[_digest(parts[3])] = Principal(parts[0], parts[1], parts[2])
    return out


class AccessControl:
    """Authentication, authorisation and audit for one router (an aiohttp middleware)."""

    def __init__(self, api_key: str | None, control_plane_keys: list[str],
                 audit: bool = False) -> None:
        self.api_key = _digest(api_key) if api_key else None
        self.keys = parse_control_plane_keys(control_plane_keys)
        self.audit = audit
        # the data plane asks for a key once one meant for it exists (--api-key or a user key)
        self.data_keys = api_key is not None or any(p.role == "user" for p in self.keys.values())
        self.open = api_key is None and not self.keys  # no key at all: everyone is trusted

    def full_view(self, who: Principal | None) -> bool:
        """An admin key, or anyone on a router with no key: the unredacted counts."""
        return self.open or (who is not None and who.role == "admin")

    def identify(self, request: web.Request) -> Principal | None:
        """The caller's principal from ``Authorization: Bearer``; None if absent or unknown."""
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            return None
        digest = _digest(token.strip())
        found = None
        for known, principal in self.keys.items():  # constant time per candidate
            if hmac.compare_digest(known, digest):
                found = principal
        if found is None and self.api_key is not None and hmac.compare_digest(self.api_key,
                                                                               digest):
            found = Principal("api-key", "api-key", "user")
        return found

    def check(self, request: web.Request) -> tuple[web.Response | None, Principal | None]:
        """None if the call may go on, else the 401/403 to answer."""
        path = request.path
        if path in OPEN_PATHS:
            return None, None
        who = self.identify(request)
        kind = admin_kind(request.method, path)
        if kind is not None and self.keys:
            if who is None:
                return error_response(401, "an admin key is required", "unauthorized"), None
            if who.role != "admin":
                return error_response(403, "this key may not call admin routes",
                                      "forbidden"), who
            return None, who
        if self.data_keys and who is None:
            return error_response(401, "missing or invalid API key", "unauthorized"), None
        if kind == "mutating" and not is_loopback(request.remote):
            return error_response(403, "admin routes answer loopback clients only unless "
                                  "--control-plane-api-keys are configured",
                                  "forbidden"), who
        return None, who

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        denied, who = self.check(request)
        admin = admin_kind(request.method, request.path) is not None
        if denied is not None:
            self._audit(request, who, admin, denied.status)
            return denied
        request[FULL_VIEW] = self.full_view(who)
        response = await handler(request)
        self._audit(request, who, admin, response.status)
        return response

    def _audit(self, request: web.Request, who: Principal | None, admin: bool,
               status: int) -> None:
        if not (self.audit and admin):
            return
        audit_log.info("control_plane_audit %s", orjson.dumps({
            "principal": who.key_id if who else None, "role": who.role if who else None,
            "remote": request.remote, "method": request.method, "path": request.path,
            "outcome": "success" if status < 400 else "denied" if status in (401, 403)
            else "error", "status": status}).decode())


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's own errors (404, 405, 413, ...) as JSON; an escaped bug as a JSON 500."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        response = error_response(exc.status, exc.reason or "error")
        if exc.status == 405 and "Allow" in exc.headers:
            response.headers["Allow"] = exc.headers["Allow"]
        return response
    except (ConnectionResetError, OSError):
        raise
    except Exception:  # noqa: BLE001 - one JSON answer, and the trace in the log
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(500, "internal router error", "internal_error")
