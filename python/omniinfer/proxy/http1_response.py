"""One worker answer as the router's HTTP/1.1 client reads it (``http1.py`` feeds it).

Status and headers are set once the head is in; the body is read whole (``read``) or as it
comes (``readany``). A stream buffered past ``PAUSE_ABOVE`` pauses its connection until the
reader catches up; an answer read whole may not grow past its ``limit`` (the router's
``--max-response-size``): past it the connection is cut and the read raises
``UpstreamTooLarge``, so a worker cannot make the router buffer an unbounded answer.
"""

from __future__ import annotations

import asyncio
from typing import Protocol


class _Connection(Protocol):
    """What an answer needs of the connection that feeds it (``http1._Connection``)."""

    paused: bool

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def close(self) -> None: ...

PAUSE_ABOVE = 1 << 20  # a stream buffered past this pauses reading until the reader catches up
NO_LIMIT = 1 << 62


class UpstreamClosed(ConnectionError):
    """The worker closed the connection before its answer was complete."""


class UpstreamProtocolError(ConnectionError):
    """The worker's answer is not HTTP/1.x the client can read."""


class UpstreamTooLarge(ConnectionError):
    """An answer read whole grew past the client's limit (the connection was cut)."""


class Response:
    """One answer: status and headers once the head is in; the body read whole or as it comes."""

    __slots__ = ("status", "headers", "keep_alive", "_conn", "_chunks", "_size", "_done", "_exc",
                 "_waiter", "_head", "_stream", "limit")

    def __init__(self, conn: _Connection, head: asyncio.Future[None], stream: bool,
                 limit: int = NO_LIMIT) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.keep_alive = False
        self._conn: _Connection | None = conn
        self._chunks: list[bytes] = []
        self._size = 0
        self._done = False
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._head = head
        self._stream = stream
        self.limit = limit

    @property
    def content_type(self) -> str:
        """The media type without parameters (what aiohttp's ``content_type`` gives)."""
        return self.headers.get("content-type", "").partition(";")[0].strip()

    async def read(self) -> bytes:
        """The whole body (waits for its end)."""
        self._stream = False
        conn = self._conn
        if conn is not None and conn.paused:
            conn.resume()
        while not self._done:
            if self._exc is not None:
                raise self._exc
            await self._wait(None)
        if self._exc is not None:
            raise self._exc
        data = b"".join(self._chunks)
        self._chunks.clear()
        self._size = 0
        return data

    async def readany(self, timeout: float | None = None) -> bytes:
        """What has arrived since the last call (waits up to ``timeout`` s for some); b"" at the end."""
        while True:
            if self._chunks:
                data = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
                self._chunks.clear()
                self._size = 0
                conn = self._conn
                if conn is not None and conn.paused:
                    conn.resume()
                return data
            if self._exc is not None:
                raise self._exc
            if self._done:
                return b""
            await self._wait(timeout)

    async def _wait(self, timeout: float | None) -> None:
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timer = None if timeout is None else loop.call_later(timeout, _expire, waiter)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def close(self) -> None:
        """Done with it: an answer read to its end has already freed its connection; one that
        was not is cut (its rest cannot be told apart from the next answer)."""
        conn, self._conn = self._conn, None
        if conn is not None and not self._done:
            conn.close()
        if not self._done and self._exc is None:
            self._exc = UpstreamClosed("answer closed before its end")

    release = close  # aiohttp's name for the same step

    # ---- fed by the connection -----------------------------------------------------------
    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        if self._size > PAUSE_ABOVE and self._conn is not None:
            if self._stream:
                self._conn.pause()
            elif self._size > self.limit:
                conn = self._conn
                self._chunks.clear()
                self._fail(UpstreamTooLarge(f"the worker's answer is over {self.limit} bytes"))
                conn.close()
                return
        self._wake()

    def _finish(self) -> None:
        self._done = True
        self._conn = None
        self._wake()

    def _fail(self, exc: BaseException) -> None:
        if self._done or self._exc is not None:
            return
        self._exc = exc
        self._conn = None
        if not self._head.done():
            self._head.set_exception(exc)
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError("no data from the worker in time"))
