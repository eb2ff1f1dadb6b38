"""The router's listening socket, guarded: a connection cap, a request-head deadline, a write
deadline, and compressed request bodies refused before anything inflates them.

aiohttp has none of these: a client may open any number of connections, trickle a request head
a byte at a time (slowloris), stop reading an answer while the router holds its slot, or send a
small gzip body that aiohttp's parser inflates to gigabytes before a handler sees it. Here every
connection is wrapped:

- past ``--max-connections`` open ones a new connection gets a 503 and is closed;
- a request head must be complete (``\\r\\n\\r\\n``) within ``--client-header-timeout-secs`` of
  its first byte, or the connection is closed. Where the head ends and where the body ends are
  found here (``framing.py``), so the deadline covers heads only, never a long body or a long
  answer; body timeouts are the handler's (``forward.py``);
- a request whose ``Content-Encoding`` is not identity gets a 415 (JSON) and the connection is
  closed before aiohttp parses the body;
- a client that accepts no bytes for ``--client-write-timeout-secs`` while an answer waits to be
  written has its connection aborted: the handler sees the disconnect, aborts the worker's
  request and gives its slot back.
aiohttp's own answers to unparsable requests (400, 413, 417 ...) are JSON too (``JsonErrors``).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import web, web_protocol

from omniinfer.proxy.framing import BodyScanner, HeadInfo

log = logging.getLogger("omniinfer.proxy")
TLS_HANDSHAKE_TIMEOUT_S = 10.0  # a client that opens a connection and never finishes a handshake
MAX_TRACKED_HEAD = 64 * 1024  # beyond this aiohttp refuses the head itself (its line limits)


def _canned(status: str, message: str, kind: str, extra: str = "") -> bytes:
    code = int(status.split()[0])
    body = orjson.dumps({"error": {"message": message, "type": kind, "code": code}})
    return (f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n{extra}"
            f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


BUSY = _canned("503 Service Unavailable", "too many open connections", "overloaded",
               "Retry-After: 1\r\n")


def _unsupported(encoding: str) -> bytes:
    return _canned("415 Unsupported Media Type",
                   f"request bodies with Content-Encoding {encoding[:40]!r} are not accepted: "
                   "send the body uncompressed", "invalid_request_error")


class JsonErrors(web_protocol.RequestHandler):
    """aiohttp's request handler whose answers to requests it cannot parse are JSON."""

    __slots__ = ()

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        plain = super().handle_error(request, status, exc, message)
        reason = (message or getattr(exc, "message", None) or "bad request").splitlines()[0]
        body = orjson.dumps({"error": {"message": str(reason)[:200],
                                       "type": "invalid_request_error", "code": status}})
        answer = web.Response(status=status, body=body, content_type="application/json")
        answer.force_close()
        return answer if status != 500 else plain


class ClientConnection(asyncio.Protocol):
    """One client connection: aiohttp's protocol behind the listener's connection cap, request
    framing and deadlines (head, body, write), counted."""

    def __init__(self, inner: Any, listener: Listener) -> None:
        if type(inner) is web_protocol.RequestHandler:  # same layout: answers become JSON
            inner.__class__ = JsonErrors
        self.inner = inner
        self.listener = listener
        self.transport: asyncio.Transport | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._write_deadline: asyncio.TimerHandle | None = None
        self._head: bytes | None = None  # the head being received; None between requests
        self._body: BodyScanner | None = None  # the body being received
        self._refused = False
        self._discard = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        if self.listener.open >= self.listener.max_connections:
            self._refused = True
            self.listener.refused += 1
            transport.write(BUSY)  # type: ignore[attr-defined]
            transport.close()
            return
        self.listener.open += 1
        self.inner.connection_made(transport)
        self._start_head()

    def _start_head(self) -> None:
        self._head = b""
        loop = asyncio.get_running_loop()
        self._deadline = loop.call_later(self.listener.header_timeout, self._expire)

    def _expire(self) -> None:
        self._deadline = None
        if self._head is not None and self.transport is not None:
            self.listener.head_timeouts += 1
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._refused or self._discard:
            return
        pos, n = 0, len(data)
        while pos < n:
            if self._body is not None:  # the current request's body
                pos += self._body.feed(data[pos:] if pos else data)
                if self._body.done:
                    self._body = None
                continue
            if self._head is None:
                self._start_head()  # the next request on a kept-alive connection
            seen = self._head
            assert seen is not None
            window = seen + (data[pos:] if pos else data)
            end = window.find(b"\r\n\r\n")
            if end < 0:
                self._head = window if len(window) <= MAX_TRACKED_HEAD else window[-3:]
                break
            pos += end + 4 - len(seen)
            self._head = None
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None
            info = HeadInfo.parse(window[:end])
            if info.content_encoding is not None:
                self._refuse(info.content_encoding)
                return
            body = BodyScanner(info)
            self._body = None if body.done else body
        self.inner.data_received(data)

    def _refuse(self, encoding: str) -> None:
        self.listener.encoded_refused += 1
        self._discard = True  # the rest of the connection is not read
        if self.transport is not None:
            self.transport.write(_unsupported(encoding))
            self.transport.close()

    def eof_received(self) -> bool | None:
        return None if self._refused else self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._deadline, self._write_deadline):
            if timer is not None:
                timer.cancel()
        self._deadline = self._write_deadline = None
        if self._refused:
            return
        self.listener.open -= 1
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._refused:
            return
        if self._write_deadline is None:
            loop = asyncio.get_running_loop()
            self._write_deadline = loop.call_later(self.listener.write_timeout,
                                                   self._write_expired)
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self._refused:
            return
        if self._write_deadline is not None:
            self._write_deadline.cancel()
            self._write_deadline = None
        self.inner.resume_writing()

    def _write_expired(self) -> None:
        self._write_deadline = None
        if self.transport is not None and not self.transport.is_closing():
            self.listener.write_timeouts += 1
            self.transport.abort()  # what is buffered for a client that does not read is dropped


class Listener:
    """``loop.create_server`` over aiohttp's protocol factory, with the guards above."""

    def __init__(self, factory: Callable[[], Any], max_connections: int,
                 header_timeout: float, write_timeout: float = 60.0) -> None:
        self.factory = factory
        self.max_connections = max_connections
        self.header_timeout = header_timeout
        self.write_timeout = write_timeout
        self.open = 0
        self.refused = 0
        self.head_timeouts = 0
        self.write_timeouts = 0
        self.encoded_refused = 0
        self.server: asyncio.base_events.Server | None = None

    def protocol(self) -> ClientConnection:
        return ClientConnection(self.factory(), self)

    async def start(self, host: str, port: int, backlog: int = 4096,
                    tls: ssl.SSLContext | None = None) -> None:
        """Listen; with ``tls`` the guards see the decrypted bytes (handshakes get
        ``TLS_HANDSHAKE_TIMEOUT_S``)."""
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(
            self.protocol, host, port, backlog=backlog, reuse_address=True, ssl=tls,
            ssl_handshake_timeout=TLS_HANDSHAKE_TIMEOUT_S if tls is not None else None)

    def stop_accepting(self) -> None:
        """Close the listening socket; open connections stay (``close`` waits for them)."""
        if self.server is not None:
            self.server.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    def describe(self) -> dict[str, int]:
        """Counters for /list_workers and the soak."""
        return {"open": self.open, "refused": self.refused, "head_timeouts": self.head_timeouts,
                "write_timeouts": self.write_timeouts,
                "compressed_bodies_refused": self.encoded_refused}
