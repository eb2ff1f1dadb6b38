"""CORS for browser clients (``--cors-allowed-origins``), as sglang-router configures it.

Only when origins are given: then a request whose ``Origin`` is one of them (or any, with the
entry ``*``) gets ``Access-Control-Allow-Origin`` with that origin, ``Vary: Origin`` and
``x-request-id`` exposed, streams included (the headers are added as each answer is
prepared), and a preflight ``OPTIONS`` is answered 204 before authentication (browsers send no
key with it) with the methods GET, POST, PATCH, DELETE, OPTIONS and the headers Content-Type
and Authorization, cached for an hour. Without origins nothing is added, so browsers keep the
same-origin rule (sglang-router allows every origin then; here a deployment opts in).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from aiohttp import web

METHODS = "GET, POST, PATCH, DELETE, OPTIONS"
HEADERS = "Content-Type, Authorization"
MAX_AGE_S = 3600
MAX_ORIGINS = 256


def check_origins(origins: Sequence[str]) -> None:
    """ValueError unless every entry is ``*`` or ``scheme://host[:port]``, at most 256."""
    if len(origins) > MAX_ORIGINS:
        raise ValueError(f"--cors-allowed-origins: at most {MAX_ORIGINS} origins")
    for origin in origins:
        if origin == "*":
            continue
        scheme, sep, rest = origin.partition("://")
        if not sep or scheme not in ("http", "https") or not rest or "/" in rest \
                or not origin.isascii() or not origin.isprintable() or " " in origin:
            raise ValueError(f"--cors-allowed-origins: {origin[:80]!r} is not an origin "
                             "(scheme://host[:port], or *)")


class Cors:
    """The allowed origins; ``install`` adds the preflight middleware and the answer hook."""

    def __init__(self, origins: Sequence[str]) -> None:
        check_origins(origins)
        self.any = "*" in origins
        self.origins = frozenset(o.lower() for o in origins if o != "*")

    def allowed(self, origin: str | None) -> bool:
        return origin is not None and (self.any or origin.lower() in self.origins)

    def install(self, app: web.Application) -> None:
        app.middlewares.insert(0, self.preflight)  # before authentication
        app.on_response_prepare.append(self.decorate)

    @web.middleware
    async def preflight(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.method != "OPTIONS" or "Access-Control-Request-Method" not in request.headers:
            return await handler(request)
        origin = request.headers.get("Origin")
        if not self.allowed(origin):
            return web.Response(status=403, text="origin not allowed")
        return web.Response(status=204, headers={
            "Access-Control-Allow-Origin": origin or "",
            "Access-Control-Allow-Methods": METHODS,
            "Access-Control-Allow-Headers": HEADERS,
            "Access-Control-Max-Age": str(MAX_AGE_S),
            "Vary": "Origin"})

    async def decorate(self, request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if self.allowed(origin) and "Access-Control-Allow-Origin" not in response.headers:
            response.headers["Access-Control-Allow-Origin"] = origin or ""
            response.headers["Access-Control-Expose-Headers"] = "x-request-id"
            response.headers.add("Vary", "Origin")
