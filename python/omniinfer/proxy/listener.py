"""The router's listening socket, guarded: a connection cap and a request-head deadline.

aiohttp has neither: a client may open any number of connections and trickle a request head a
byte at a time (slowloris), holding each forever. Here every connection is wrapped: past
``--max-connections`` open ones a new connection gets a 503 and is closed; a request head must
be complete (``\\r\\n\\r\\n``) within ``--client-header-timeout-secs`` of its first byte, or
the connection is closed. Body timeouts are the handler's (``forward.py``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("omniinfer.proxy")
_BUSY_BODY = b'{"error":{"message":"too many open connections","type":"overloaded","code":503}}'
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        b"Retry-After: 1\r\nConnection: close\r\nContent-Length: "
        + str(len(_BUSY_BODY)).encode() + b"\r\n\r\n" + _BUSY_BODY)


class Guarded(asyncio.Protocol):
    """Delegates to aiohttp's protocol; watches the head deadline and counts connections."""

    def __init__(self, inner: Any, listener: Listener) -> None:
        self.inner = inner
        self.listener = listener
        self.transport: asyncio.Transport | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._in_head = False
        self._tail = b""
        self._refused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        if self.listener.open >= self.listener.max_connections:
            self._refused = True
            self.listener.refused += 1
            transport.write(BUSY)
            transport.close()
            return
        self.listener.open += 1
        self.inner.connection_made(transport)
        self._start_head()

    def _start_head(self) -> None:
        self._in_head = True
        self._tail = b""
        loop = asyncio.get_running_loop()
        self._deadline = loop.call_later(self.listener.header_timeout, self._expire)

    def _expire(self) -> None:
        self._deadline = None
        if self._in_head and self.transport is not None:
            self.listener.head_timeouts += 1
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if not self._in_head and not getattr(self.inner, "_request_in_progress", True):
            self._start_head()  # the next request on a kept-alive connection
        if self._in_head:
            window = self._tail + data
            if b"\r\n\r\n" in window:
                self._in_head = False
                if self._deadline is not None:
                    self._deadline.cancel()
                    self._deadline = None
            else:
                self._tail = window[-3:]
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return None if self._refused else self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        if self._refused:
            return
        self.listener.open -= 1
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if not self._refused:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if not self._refused:
            self.inner.resume_writing()


class Listener:
    """``loop.create_server`` over aiohttp's protocol factory, with the guards above."""

    def __init__(self, factory: Callable[[], Any], max_connections: int,
                 header_timeout: float) -> None:
        self.factory = factory
        self.max_connections = max_connections
        self.header_timeout = header_timeout
        self.open = 0
        self.refused = 0
        self.head_timeouts = 0
        self.server: asyncio.base_events.Server | None = None

    def protocol(self) -> Guarded:
        return Guarded(self.factory(), self)

    async def start(self, host: str, port: int, backlog: int = 4096) -> None:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(self.protocol, host, port, backlog=backlog,
                                               reuse_address=True)

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    def describe(self) -> dict[str, int]:
        return {"open": self.open, "refused": self.refused, "head_timeouts": self.head_timeouts}
