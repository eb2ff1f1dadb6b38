"""The router's lean HTTP/1.1 client against raw sockets that answer byte by byte as told."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from omniinfer.proxy.http1 import Http1Pool
from omniinfer.proxy.http1_response import PAUSE_ABOVE, UpstreamClosed, UpstreamProtocolError

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One request (head, body) as the server sees it."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head, await reader.readexactly(length)


@contextlib.asynccontextmanager
async def raw_server(handler: Handler) -> AsyncIterator[str]:
    connections: list[asyncio.StreamWriter] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        for w in connections:
            w.close()


@contextlib.asynccontextmanager
async def pool_for(handler: Handler, *args: Any, **kwargs: Any) -> AsyncIterator[tuple[str, Http1Pool]]:
    """A raw server running ``handler`` and a client pool for it, closed after."""
    async with raw_server(handler) as url:
        pool = Http1Pool(*args, **kwargs)
        try:
            yield url, pool
        finally:
            await pool.close()


def answer(body: bytes, extra: bytes = b"") -> bytes:
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json; charset=utf-8\r\n" + extra +
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def chunked(*parts: bytes, trailer: bytes = b"") -> bytes:
    out = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    for p in parts:
        out += f"{len(p):x};ext=1\r\n".encode() + p + b"\r\n"
    return out + b"0\r\n" + trailer + b"\r\n"


def run(coro: Awaitable[None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 20))  # type: ignore[arg-type]


def test_keep_alive_reuses_one_connection_and_sends_the_head_once_built() -> None:
    seen: list[tuple[bytes, bytes]] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head, body = await read_request(reader)
            seen.append((head, body))
            writer.write(answer(b'{"n":' + str(len(seen)).encode() + b"}"))

    async def main() -> None:
        async with pool_for(handler, {"Authorization": "Bearer k"}) as (url, pool):
            for i in range(3):
                resp = await pool.post(url, "/generate", b'{"i":%d}' % i)
                assert resp.status == 200
                assert resp.content_type == "application/json"
                assert await resp.read() == b'{"n":%d}' % (i + 1)
                resp.release()
            assert pool.connections_opened == 1
            assert pool.idle_count(url) == 1
        head, body = seen[2]
        assert head.startswith(b"POST /generate HTTP/1.1\r\n")
        assert b"\r\nHost: 127.0.0.1:" in head and b"\r\nAuthorization: Bearer k\r\n" in head
        assert b"\r\nContent-Length: 7\r\n" in head and body == b'{"i":2}'

    run(main())


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_chunked_answer_split_anywhere_is_put_back_together(step: int) -> None:
    events = [b"data: {\"a\":1}\n\n", b"data: " + b"x" * 300 + b"\n\n", b"data: [DONE]\n\n"]
    wire = chunked(*events, trailer=b"X-Trailer: 1\r\n") + answer(b"{}")  # then a second answer

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        first = wire.index(b"HTTP/1.1", 10)
        for i in range(0, first, step):
            writer.write(wire[i:min(i + step, first)])
            await writer.drain()
            await asyncio.sleep(0)
        await read_request(reader)
        writer.write(wire[first:])

    async def main() -> None:
        async with pool_for(handler) as (url, pool):
            resp = await pool.post(url, "/generate", b"{}", stream=True)
            assert resp.headers["transfer-encoding"] == "chunked"
            got = b""
            while chunk := await resp.readany(5.0):
                got += chunk
            assert got == b"".join(events)
            resp.close()  # read to its end: the connection went back already
            second = await pool.post(url, "/generate", b"{}")
            assert await second.read() == b"{}"
            assert pool.connections_opened == 1

    run(main())


def test_interim_answer_is_skipped_and_until_eof_body_is_read_whole() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n"
                     b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\npart one, ")
        await writer.drain()
        writer.write(b"part two")
        await writer.drain()
        writer.close()

    async def main() -> None:
        async with pool_for(handler) as (url, pool):
            resp = await pool.post(url, "/x", b"{}")
            assert resp.status == 200 and not resp.keep_alive
            assert await resp.read() == b"part one, part two"
            assert pool.idle_count() == 0

    run(main())


def test_connection_close_and_an_early_release_are_not_reused() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head, _ = await read_request(reader)
            if b"/close" in head:
                writer.write(answer(b"{}", b"Connection: close\r\n"))
            else:  # announces more than it sends: the reader lets go before the end
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n0123")

    async def main() -> None:
        async with pool_for(handler) as (url, pool):
            resp = await pool.post(url, "/close", b"{}")
            await resp.read()
            assert pool.idle_count() == 0
            resp = await pool.post(url, "/partial", b"{}", stream=True)
            assert await resp.readany(2.0) == b"0123"
            resp.release()
            assert pool.idle_count() == 0
            with pytest.raises(UpstreamClosed):
                await resp.read()
            assert pool.connections_opened == 2

    run(main())


def test_a_reused_connection_the_worker_dropped_is_retried_once_on_a_new_one() -> None:
    served = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal served
        await read_request(reader)
        served += 1
        writer.write(answer(b"{}"))
        await writer.drain()
        # then drop the idle connection without a word, as a keep-alive timeout does
        await reader.read(1)

    async def main() -> None:
        async with pool_for(handler) as (url, pool):
            for _ in range(3):
                resp = await pool.post(url, "/generate", b"{}")
                assert await resp.read() == b"{}"
            assert served == 3
            assert pool.connections_opened == 3  # each reuse found a dropped one and retried

    run(main())


def test_idle_connections_past_keepalive_are_not_reused() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            writer.write(answer(b"{}"))

    async def main() -> None:
        async with pool_for(handler, keepalive_secs=0.05) as (url, pool):
            await (await pool.post(url, "/a", b"{}")).read()
            await asyncio.sleep(0.1)
            await (await pool.post(url, "/a", b"{}")).read()
            assert pool.connections_opened == 2
            # a burst leaves extra connections idle; once past keep-alive they are closed as
            # soon as another one is given back, not kept until the worker drops them
            pool.keepalive_secs = 0.3
            burst = await asyncio.gather(*(pool.post(url, "/a", b"{}") for _ in range(4)))
            for resp in burst:
                await resp.read()
            assert pool.idle_count(url) == 4
            await asyncio.sleep(0.2)
            await (await pool.post(url, "/a", b"{}")).read()  # reuses the newest: all are kept
            assert pool.idle_count(url) == 4
            await asyncio.sleep(0.15)
            await (await pool.post(url, "/a", b"{}")).read()  # the other three are now stale
            assert pool.idle_count(url) == 1
            pool.drop(url)
            assert pool.idle_count(url) == 0

    run(main())


def test_timeouts_total_and_idle_read_and_connect_refused() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head, _ = await read_request(reader)
        if b"/stream" in head:
            writer.write(chunked(b"data: 1\n\n")[:-5])  # one event, then nothing
        await asyncio.sleep(30)

    async def main() -> None:
        async with pool_for(silent) as (url, pool):
            loop = asyncio.get_running_loop()
            start = loop.time()
            with pytest.raises(TimeoutError):
                await pool.post(url, "/hang", b"{}", total_timeout=0.2)
            assert loop.time() - start < 2.0
            resp = await pool.post(url, "/stream", b"{}", stream=True, total_timeout=10)
            assert await resp.readany(1.0) == b"data: 1\n\n"
            with pytest.raises(TimeoutError):
                await resp.readany(0.1)
            resp.close()
        pool = Http1Pool()
        with pytest.raises(OSError):
            await pool.post(url, "/gone", b"{}", connect_timeout=1.0)

    run(main())


@pytest.mark.parametrize("wire", [
    b"SPDY/3 200 OK\r\n\r\n",
    b"HTTP/1.1 abc OK\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabXX",
    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nabc",
    b"HTTP/1.1 200 OK\r\nX: " + b"y" * 70000,
    # found by the round-two probe: each was read as a valid answer before
    b"HTTP/1.1 200 OK\r\nX: " + b"y" * 70000 + b"\r\nContent-Length: 2\r\n\r\n{}",
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\nX-Evil: 1\r\nContent-Length: 2\r\n\r\n{}",
    b"HTTP/1.1 200 OK\r\nX-A: a\rb\r\nContent-Length: 2\r\n\r\n{}",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x1\r\na\r\n0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n+1\r\na\r\n0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1_0\r\naaaaaaaaaaaaaaaa\r\n0\r\n\r\n",
])
def test_an_unreadable_answer_fails_as_a_connection_error(wire: bytes) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(wire)
        await asyncio.sleep(5)

    async def main() -> None:
        async with pool_for(handler) as (url, pool):
            with pytest.raises(ConnectionError) as info:
                resp = await pool.post(url, "/x", b"{}")
                await resp.read()
            assert isinstance(info.value, UpstreamProtocolError)
            assert pool.idle_count() == 0

    run(main())


def test_truncated_body_and_cancelled_wait_close_the_connection() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head, _ = await read_request(reader)
        if b"/cut" in head:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n01234")
            await writer.drain()
            writer.close()
        else:
            await asyncio.sleep(30)

    async def main() -> None:
        async with pool_for(handler) as (url, pool):
            resp = await pool.post(url, "/cut", b"{}")
            with pytest.raises(UpstreamClosed):
                await resp.read()
            task = asyncio.ensure_future(pool.post(url, "/slow", b"{}"))
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.05)
            assert pool.idle_count() == 0 and not pool._open

    run(main())


def test_a_slow_reader_pauses_the_socket_and_loses_nothing() -> None:
    part = b"z" * 65536
    count = (3 * PAUSE_ABOVE) // len(part)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: " + str(count * len(part)).encode() +
                     b"\r\n\r\n")
        for _ in range(count):
            writer.write(part)
            await writer.drain()

    async def main() -> None:
        async with pool_for(handler) as (url, pool):
            resp = await pool.post(url, "/big", b"{}", stream=True)
            await asyncio.sleep(0.5)  # the worker writes far ahead of the reader
            conn = next(iter(pool._open))
            assert conn.paused
            assert resp._size <= PAUSE_ABOVE + 2 * len(part) + 65536 * 4
            total = 0
            while chunk := await resp.readany(5.0):
                total += len(chunk)
            assert total == count * len(part)

    run(main())


def test_a_stream_whose_head_never_comes_fails_at_the_head_timeout() -> None:
    """The first-byte timeout covers the answer head too (before, only the total did)."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(30)

    async def main() -> None:
        async with pool_for(handler) as (url, pool):
            started = asyncio.get_running_loop().time()
            with pytest.raises(TimeoutError):
                await pool.post(url, "/generate", b"{}", stream=True, total_timeout=20,
                                head_timeout=0.3)
            assert asyncio.get_running_loop().time() - started < 3

    run(main())


def test_an_answer_read_whole_past_the_cap_is_cut() -> None:
    from omniinfer.proxy.http1_response import UpstreamTooLarge

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(answer(b"z" * (6 << 20)))
        await writer.drain()

    async def main() -> None:
        async with pool_for(handler, max_answer_bytes=2 << 20) as (url, pool):
            resp = await pool.post(url, "/generate", b"{}")
            with pytest.raises(UpstreamTooLarge):
                await resp.read()
            assert pool.idle_count() == 0

    run(main())
