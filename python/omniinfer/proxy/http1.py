"""A lean HTTP/1.1 client for the router's hot path: POST a JSON body to a worker, read its answer.

Why not aiohttp's client: per request it builds a request object, a response object, timers,
tracing hooks and a stream reader, and looks the connection up through a connector; that was
about a third of the router's CPU per request. This client keeps a LIFO pool of keep-alive
connections per worker, writes a request head that is built once per (worker, path), and parses
the answer in an ``asyncio.Protocol``: Content-Length, chunked and read-until-close bodies.

Failures surface as ``ConnectionError`` (an ``OSError``) or ``TimeoutError``, what the callers
already catch. A connection idle for longer than ``keepalive_secs`` is not reused (SGLang's
server drops idle connections after 5 s); a reused connection that the worker closed before
sending a byte is retried once on a new connection, as browsers do.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from typing import Any
from urllib.parse import urlsplit

from omniinfer.proxy.http1_response import (
    NO_LIMIT,
    Response,
    UpstreamClosed,
    UpstreamProtocolError,
)

MAX_HEAD = 64 * 1024  # a worker's status line + headers
MAX_CHUNK_LINE = 1024  # a chunk-size line (size, extensions)
HEX_DIGITS = frozenset(b"0123456789abcdefABCDEF")
MAX_ORIGINS = 4096  # workers whose parsed URL and request heads are kept
MAX_HEADS_PER_ORIGIN = 64  # paths a head is kept for, per worker

# parser states
_HEAD, _LENGTH, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_CRLF, _TRAILER, _UNTIL_EOF, _DONE = range(8)


class _Connection(asyncio.Protocol):
    """One keep-alive connection to a worker; parses one answer at a time."""

    def __init__(self, pool: Http1Pool, origin: Origin) -> None:
        self.pool = pool
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.response: Response | None = None
        self.state = _DONE
        self.buf = b""
        self.remaining = 0
        self.received = False  # any byte of the current answer
        self.closed = False
        self.paused = False
        self.idle_since = 0.0
        self.deadline: asyncio.TimerHandle | None = None
        self.head_deadline: asyncio.TimerHandle | None = None

    # ---- asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.received = True
        if self.response is None:  # bytes nobody asked for: the connection cannot be trusted
            self.close()
            return
        try:
            self._parse(data)
        except UpstreamProtocolError as exc:
            self._fail(exc)

    def eof_received(self) -> bool:
        return False  # close our side too; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool._forget(self)
        if self.state == _UNTIL_EOF and exc is None:
            self._complete()
        elif self.response is not None:
            self._fail(UpstreamClosed(f"worker closed the connection ({exc or 'EOF'})"))
        self._stop_deadline()

    # ---- the exchange ------------------------------------------------------------------------
    def send(self, data: bytes, stream: bool, total: float | None, head: float | None = None,
             limit: int = NO_LIMIT) -> Response:
        """Write one request; ``total`` bounds the whole answer, ``head`` its status line and
        headers, ``limit`` the body when it is read whole."""
        loop = asyncio.get_running_loop()
        resp = Response(self, loop.create_future(), stream, limit)
        self.response = resp
        self.state, self.buf, self.received = _HEAD, b"", False
        if total is not None:
            self.deadline = loop.call_later(total, self._on_deadline)
        if head is not None and (total is None or head < total):
            self.head_deadline = loop.call_later(head, self._on_head_deadline)
        assert self.transport is not None
        self.transport.write(data)
        return resp

    def _on_deadline(self) -> None:
        self.deadline = None
        self._fail(TimeoutError("the worker's answer did not complete in time"))

    def _on_head_deadline(self) -> None:
        self.head_deadline = None
        if self.state == _HEAD:
            self._fail(TimeoutError("the worker sent no answer head in time"))

    def _stop_deadline(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None
        self._stop_head_deadline()

    def _stop_head_deadline(self) -> None:
        if self.head_deadline is not None:
            self.head_deadline.cancel()
            self.head_deadline = None

    def _fail(self, exc: BaseException) -> None:
        resp, self.response = self.response, None
        if resp is not None:
            resp._fail(exc)
        self.close()

    def _complete(self) -> None:
        resp, self.response = self.response, None
        self.state = _DONE
        self._stop_deadline()
        if resp is None:
            return
        keep = resp.keep_alive and not self.buf and not self.closed
        resp._finish()
        if keep:
            self.pool._give_back(self)
        else:
            self.close()

    def pause(self) -> None:
        if not self.paused and self.transport is not None and not self.closed:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        self._stop_deadline()
        if not self.closed:
            self.closed = True
            self.pool._forget(self)
            if self.transport is not None:
                self.transport.close()

    # ---- parsing -----------------------------------------------------------------------------
    def _parse(self, data: bytes) -> None:
        if self.state == _HEAD:
            data = self._parse_head(data)
        if self.state == _LENGTH:
            if len(data) > self.remaining:
                raise UpstreamProtocolError("more body than Content-Length said")
            self.remaining -= len(data)
            if data:
                self.response._feed(data)  # type: ignore[union-attr]
            if self.remaining == 0:
                self._complete()
        elif self.state == _UNTIL_EOF:
            if data:
                self.response._feed(data)  # type: ignore[union-attr]
        elif self.state in (_CHUNK_SIZE, _CHUNK_DATA, _CHUNK_CRLF, _TRAILER):
            self._parse_chunked(self.buf + data if self.buf else data)

    def _parse_head(self, data: bytes) -> bytes:
        buf = self.buf + data if self.buf else data
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0 or end > MAX_HEAD:
                if len(buf) > MAX_HEAD:
                    raise UpstreamProtocolError("response head too large")
                self.buf = buf
                return b""
            head, buf = buf[:end], buf[end + 4:]
            lines = head.split(b"\r\n")
            parts = lines[0].split(b" ", 2)
            if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
                raise UpstreamProtocolError(f"bad status line {lines[0][:80]!r}")
            status = int(parts[1])
            if 100 <= status < 200:
                continue  # an interim answer (103 Early Hints, ...): the real one follows
            break
        self.buf = b""
        self._stop_head_deadline()
        crlf = head.count(b"\r\n")
        if head.count(b"\n") != crlf or head.count(b"\r") != crlf or b"\x00" in head:
            raise UpstreamProtocolError("bare CR or LF, or NUL, in the answer head")
        resp = self.response
        assert resp is not None
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep:
                raise UpstreamProtocolError(f"bad header line {line[:80]!r}")
            key = name.strip().lower().decode("latin-1")
            text = value.strip().decode("latin-1")
            headers[key] = f"{headers[key]}, {text}" if key in headers else text
        resp.status, resp.headers = status, headers
        connection = headers.get("connection", "").lower()
        resp.keep_alive = "close" not in connection if parts[0] == b"HTTP/1.1" \
            else "keep-alive" in connection
        if status in (204, 304):
            self.state = _LENGTH
            self.remaining = 0
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            self.state = _CHUNK_SIZE
        elif "content-length" in headers:
            length = headers["content-length"]
            if not length.isdigit():
                raise UpstreamProtocolError(f"bad Content-Length {length[:40]!r}")
            self.state, self.remaining = _LENGTH, int(length)
        else:
            self.state = _UNTIL_EOF
            resp.keep_alive = False
        resp._head.set_result(None)
        return buf

    def _parse_chunked(self, buf: bytes) -> None:
        pos, n, resp = 0, len(buf), self.response
        assert resp is not None
        while pos < n or self.state == _TRAILER:
            if self.state == _CHUNK_SIZE:
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    if n - pos > MAX_CHUNK_LINE:
                        raise UpstreamProtocolError("chunk-size line too long")
                    break
                size_text = buf[pos:end].partition(b";")[0].rstrip(b" \t")
                if not size_text or not HEX_DIGITS.issuperset(size_text) or len(size_text) > 16:
                    raise UpstreamProtocolError(f"bad chunk size {size_text[:20]!r}")
                size = int(size_text, 16)
                pos = end + 2
                if size == 0:
                    self.state = _TRAILER
                else:
                    self.state, self.remaining = _CHUNK_DATA, size
            elif self.state == _CHUNK_DATA:
                take = min(self.remaining, n - pos)
                resp._feed(buf[pos:pos + take] if (pos, take) != (0, n) else buf)
                pos += take
                self.remaining -= take
                if self.remaining == 0:
                    self.state = _CHUNK_CRLF
            elif self.state == _CHUNK_CRLF:
                if n - pos < 2:
                    break
                if buf[pos:pos + 2] != b"\r\n":
                    raise UpstreamProtocolError("chunk not followed by CRLF")
                pos += 2
                self.state = _CHUNK_SIZE
            else:  # _TRAILER: an empty line, or trailer fields then an empty line
                if buf.startswith(b"\r\n", pos):
                    pos += 2
                else:
                    end = buf.find(b"\r\n\r\n", pos)
                    if end < 0:
                        if n - pos > MAX_HEAD:
                            raise UpstreamProtocolError("trailers too large")
                        break
                    pos = end + 4
                self.buf = buf[pos:]
                self._complete()
                return
        self.buf = buf[pos:] if pos < n else b""


class Origin:
    """A worker's scheme, host and port, parsed once, with the request heads built for it."""

    __slots__ = ("url", "host", "port", "tls", "host_header", "heads")

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) origin: {url!r}")
        self.url = url
        self.tls = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.tls else 80)
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.tls else 80
        self.host_header = host if self.port == default else f"{host}:{self.port}"
        self.heads: dict[str, bytes] = {}


class Http1Pool:
    """Keep-alive connections per worker and the POST that uses them."""

    def __init__(self, headers: dict[str, str] | None = None, keepalive_secs: float = 4.0,
                 max_idle_per_origin: int = 256, max_answer_bytes: int = NO_LIMIT,
                 tls: ssl.SSLContext | None = None) -> None:
        self.extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self.max_answer_bytes = max_answer_bytes
        self.keepalive_secs = keepalive_secs
        self.max_idle = max_idle_per_origin
        self._origins: dict[str, Origin] = {}
        self._idle: dict[str, deque[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._tls = tls  # for https:// origins (None: the system's defaults, made when needed)
        self.connections_opened = 0

    def origin(self, url: str) -> Origin:
        origin = self._origins.get(url)
        if origin is None:
            if len(self._origins) >= MAX_ORIGINS:
                self._origins.clear()
            origin = self._origins[url] = Origin(url)
        return origin

    async def post(self, url: str, path: str, payload: bytes, *, stream: bool = False,
                   connect_timeout: float | None = None,
                   total_timeout: float | None = None,
                   head_timeout: float | None = None, extra: bytes = b"") -> Response:
        """POST ``payload`` (JSON) to ``url + path``; returns once the answer's head is in.
        ``extra``: header lines of this request only (each ending ``\\r\\n``).

        ``total_timeout`` bounds the whole exchange, ``head_timeout`` the wait for the answer's
        head once the request is written; an answer read whole may not exceed the pool's
        ``max_answer_bytes`` (``UpstreamTooLarge``)."""
        origin = self.origin(url)
        head = origin.heads.get(path)
        if head is None:
            if len(origin.heads) >= MAX_HEADS_PER_ORIGIN:
                origin.heads.clear()
            head = origin.heads[path] = (
                f"POST {path} HTTP/1.1\r\nHost: {origin.host_header}\r\n{self.extra}"
                f"Content-Type: application/json\r\nContent-Length: ").encode("latin-1")
        data = head + str(len(payload)).encode() + b"\r\n" + extra + b"\r\n" + payload
        loop = asyncio.get_running_loop()
        deadline = None if total_timeout is None else loop.time() + total_timeout
        conn = self._reuse(origin)
        if conn is not None:
            try:
                return await self._exchange(conn, data, stream, deadline, head_timeout, loop)
            except UpstreamClosed:
                if conn.received:
                    raise
                # the worker dropped an idle connection as it was reused: once more, on a new one
        conn = await self._connect(origin, connect_timeout, deadline, loop)
        return await self._exchange(conn, data, stream, deadline, head_timeout, loop)

    async def _exchange(self, conn: _Connection, data: bytes, stream: bool,
                        deadline: float | None, head_timeout: float | None,
                        loop: asyncio.AbstractEventLoop) -> Response:
        total = None if deadline is None else max(0.0, deadline - loop.time())
        resp = conn.send(data, stream, total, head_timeout, self.max_answer_bytes)
        try:
            await resp._head
        except BaseException:
            resp.close()
            raise
        return resp

    def _reuse(self, origin: Origin) -> _Connection | None:
        idle = self._idle.get(origin.url)
        if not idle:
            return None
        now = time.monotonic()
        while idle:
            conn = idle.pop()  # the most recently used: the least likely to be dropped
            if conn.closed or conn.transport is None or conn.transport.is_closing():
                conn.close()
                continue
            if now - conn.idle_since > self.keepalive_secs:
                conn.close()
                continue
            return conn
        return None

    async def _connect(self, origin: Origin, timeout: float | None, deadline: float | None,
                       loop: asyncio.AbstractEventLoop) -> _Connection:
        if deadline is not None:
            left = max(0.0, deadline - loop.time())
            timeout = left if timeout is None else min(timeout, left)
        tls: Any = None
        if origin.tls:
            if self._tls is None:
                self._tls = ssl.create_default_context()
            tls = self._tls
        opening = loop.create_connection(lambda: _Connection(self, origin), origin.host,
                                         origin.port, ssl=tls)
        try:
            _, conn = await asyncio.wait_for(opening, timeout)
        except TimeoutError:
            raise TimeoutError(f"connecting to {origin.url} took over {timeout} s") from None
        self.connections_opened += 1
        self._open.add(conn)
        return conn

    def _give_back(self, conn: _Connection) -> None:
        idle = self._idle.get(conn.origin.url)
        if idle is None:
            idle = self._idle[conn.origin.url] = deque()
        now = time.monotonic()
        # the oldest first: past their keep-alive (a burst's extra connections) or over the cap
        stale = []
        while idle and (len(idle) >= self.max_idle or
                        now - idle[0].idle_since > self.keepalive_secs):
            stale.append(idle.popleft())
        conn.idle_since = now
        idle.append(conn)
        for old in stale:  # after the append: closing one that empties the deque would drop it
            old.close()

    def _forget(self, conn: _Connection) -> None:
        self._open.discard(conn)
        idle = self._idle.get(conn.origin.url)
        if idle is not None:
            try:
                idle.remove(conn)
            except ValueError:
                pass
            if not idle:
                del self._idle[conn.origin.url]

    def drop(self, url: str) -> None:
        """Close the idle connections to a worker (it was removed)."""
        for conn in list(self._idle.pop(url, ())):
            conn.close()
        self._origins.pop(url, None)

    def idle_count(self, url: str | None = None) -> int:
        if url is not None:
            return len(self._idle.get(url, ()))
        return sum(len(q) for q in self._idle.values())

    async def close(self) -> None:
        for conn in list(self._open):
            conn.close()
        self._idle.clear()
        self._open.clear()
        await asyncio.sleep(0)  # let the transports finish closing
