"""The router's own ZMTP 3.0 client (NULL security, TCP) for reading workers' ZMQ sockets.

Why not libzmq: its ``MAXMSGSIZE`` bounds each *frame* and its ``RCVHWM`` counts only complete
messages, so a peer that sends one message of endless small frames makes libzmq buffer all of
them before Python sees any. This client bounds the message itself.

Contract of :func:`connect` (one connection; the caller's session loop redials):

- dials ``tcp://HOST:PORT`` (IPv6 hosts in brackets); any other scheme is a ``ValueError``
  (the router is only ever given TCP endpoints: ``kv_events.split_tcp`` refuses the rest);
- greets as ZMTP 3.0 with the NULL mechanism, sends READY with ``Socket-Type`` (and
  ``Identity`` if given), and accepts only a ZMTP 3.x peer offering NULL whose READY names a
  socket type that may talk to ours (SUB: PUB, XPUB; DEALER: ROUTER, DEALER, REP); a SUB then
  sends its subscriptions as 3.0 subscription messages (``0x01`` + topic) and also filters
  what arrives by them (a hostile publisher is not trusted to);
- returns once the peer's READY is in, all within ``handshake_timeout_s``; otherwise raises
  ``ZmtpError`` naming the reason (refused, reset, timed out, bad greeting, other mechanism,
  ERROR command, wrong socket type). An unresolvable host raises ``OSError`` (``gaierror``):
  a configuration fault, not a peer's.

Afterwards ``recv_multipart`` returns complete messages in order and raises ``ZmtpError`` once
the connection is over (messages completed before that are returned first). Bounds per
connection (``ZmtpLimits``): a message of more than ``max_frames`` frames or
``max_message_bytes`` bytes in all, a command over ``max_command_bytes``, READY with more than
``max_properties`` properties, or a frame with reserved flag bits, ends the connection as soon
as its header is read (its body is never awaited). At most ``queue_messages`` complete messages
are held; then the socket stops being read (TCP pushes back on the peer), so memory is at most
``(queue_messages + 1) * max_message_bytes`` plus one read (256 KiB). At most ``PARSE_STEPS``
frames are parsed per event-loop callback, so no peer holds the loop.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import socket
from collections.abc import Sequence
from typing import cast

SUB, DEALER = "SUB", "DEALER"
PEER_TYPES = {SUB: (b"PUB", b"XPUB"), DEALER: (b"ROUTER", b"DEALER", b"REP")}
MORE, LONG, COMMAND = 0x01, 0x02, 0x04
GREETING_BYTES = 64
PARSE_STEPS = 256  # frames parsed per event-loop callback before yielding
_GREETING = (b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00")
             + b"\x00" + b"\x00" * 31)
assert len(_GREETING) == GREETING_BYTES


@dataclasses.dataclass(frozen=True)
class ZmtpLimits:
    """What one peer may make the router hold (see the module for what passing one does)."""

    max_message_bytes: int = 4 << 20  # all frames of one message together
    max_frames: int = 16  # frames per message (KV events and load readings have 3, replies 4)
    queue_messages: int = 16  # complete messages held before the socket stops being read
    max_command_bytes: int = 4096  # READY (and any later command), name and metadata included
    max_properties: int = 32  # metadata properties in the peer's READY
    handshake_timeout_s: float = 5.0  # TCP connect, greetings and READY together

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            if not getattr(self, field.name) > 0:
                raise ValueError(f"ZmtpLimits.{field.name} must be positive")


class ZmtpError(Exception):
    """The connection is over, or never began, for the reason in the message."""


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` → (host without brackets, port); ``ValueError`` for anything else."""
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"endpoint {endpoint!r}: only tcp://HOST:PORT is supported (workers "
                         "are dialled over TCP; ipc:// and inproc:// are not reachable here)")
    host, sep, port = endpoint[len("tcp://"):].rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"endpoint {endpoint!r} is not tcp://HOST:PORT")
    return host.strip("[]"), int(port)


def frame(body: bytes, flags: int = 0) -> bytes:
    """One ZMTP frame: flags, a 1-byte size (or ``LONG`` and 8 bytes) and the body."""
    if len(body) > 255:
        return bytes((flags | LONG,)) + len(body).to_bytes(8, "big") + body
    return bytes((flags, len(body))) + body


def ready_command(socket_type: str, identity: bytes | None = None) -> bytes:
    """The READY command frame announcing ``socket_type`` (and ``identity``)."""
    props = [(b"Socket-Type", socket_type.encode())]
    if identity is not None:
        props.append((b"Identity", identity))
    body = b"\x05READY" + b"".join(bytes((len(n),)) + n + len(v).to_bytes(4, "big") + v
                                   for n, v in props)
    return frame(body, COMMAND)


def parse_properties(data: bytes, max_properties: int) -> dict[bytes, bytes]:
    """READY metadata → {lower-cased name: value}; ``ZmtpError`` if malformed or too many."""
    props: dict[bytes, bytes] = {}
    i, count = 0, 0
    while i < len(data):
        count += 1
        if count > max_properties:
            raise ZmtpError(f"READY with more than {max_properties} properties")
        size = data[i]
        name = data[i + 1:i + 1 + size]
        i += 1 + size
        if size == 0 or len(name) < size or i + 4 > len(data):
            raise ZmtpError("malformed READY metadata")
        length = int.from_bytes(data[i:i + 4], "big")
        i += 4
        if i + length > len(data):
            raise ZmtpError("malformed READY metadata")
        props.setdefault(name.lower(), data[i:i + length])
        i += length
    return props


class _Protocol(asyncio.Protocol):
    """The state machine behind one connection: greeting, READY, then traffic."""

    def __init__(self, socket_type: str, limits: ZmtpLimits, topics: Sequence[bytes],
                 identity: bytes | None) -> None:
        self.socket_type, self.limits = socket_type, limits
        self.topics, self.identity = tuple(topics), identity
        self.loop = asyncio.get_running_loop()
        self.handshaken: asyncio.Future[str | None] = self.loop.create_future()
        self.transport: asyncio.Transport | None = None
        self.state = "greeting"  # then "ready" (awaiting the peer's READY), then "traffic"
        self.peer_type = ""
        self.buf = bytearray()
        self.pos = 0  # parsed up to here
        self.parts: list[bytes] = []  # frames of the message being received
        self.size = 0  # their bytes
        self.queue: collections.deque[list[bytes]] = collections.deque()
        self.error: str | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.paused = self.scheduled = False

    # ---- asyncio.Protocol ----
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        transport.write(_GREETING)

    def data_received(self, data: bytes) -> None:
        if self.error is None:
            self.buf += data
            self.pump()

    def eof_received(self) -> bool:
        return False  # close our side too; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail("the peer closed the connection" if exc is None else f"connection lost: {exc}")
        self.transport = None

    # ---- parsing ----
    def pump(self) -> None:
        """Parse what is buffered, up to a full queue or ``PARSE_STEPS`` frames (then go on in
        a later callback), and pause or resume reading to match."""
        self.scheduled = False
        try:
            for _ in range(PARSE_STEPS):
                if self.error is not None or len(self.queue) >= self.limits.queue_messages \
                        or not self.step():
                    break
            else:
                self.scheduled = True
                self.loop.call_soon(self.pump)
        except ZmtpError as exc:
            self.fail(str(exc))
            return
        if self.pos:
            del self.buf[:self.pos]
            self.pos = 0
        self.flow()

    def flow(self) -> None:
        transport = self.transport
        if transport is None or self.error is not None:
            return
        pause = self.scheduled or len(self.queue) >= self.limits.queue_messages
        if pause != self.paused:
            (transport.pause_reading if pause else transport.resume_reading)()
            self.paused = pause

    def step(self) -> bool:
        """Consume one greeting, command or frame if it is all buffered; False if not."""
        buf, pos, limits = self.buf, self.pos, self.limits
        avail = len(buf) - pos
        if self.state == "greeting":
            if avail and buf[pos] != 0xFF:
                raise ZmtpError("not a ZMTP peer (bad greeting signature)")
            if avail < GREETING_BYTES:
                return False
            self.greeting(bytes(buf[pos:pos + GREETING_BYTES]))
            self.pos += GREETING_BYTES
            return True
        if avail < 2:
            return False
        flags = buf[pos]
        if flags & ~(MORE | LONG | COMMAND):
            raise ZmtpError(f"frame flags {flags:#04x} set reserved bits")
        head = 9 if flags & LONG else 2
        if avail < head:
            return False
        size = int.from_bytes(buf[pos + 1:pos + head], "big")
        if flags & COMMAND:
            if flags & MORE or self.parts:
                raise ZmtpError("a command inside a message")
            if size > limits.max_command_bytes:
                raise ZmtpError(f"a command of {size} bytes (at most {limits.max_command_bytes})")
        elif self.state != "traffic":
            raise ZmtpError("a message before the handshake ended")
        elif len(self.parts) >= limits.max_frames:
            raise ZmtpError(f"a message of more than {limits.max_frames} frames")
        elif self.size + size > limits.max_message_bytes:
            raise ZmtpError(f"a message of more than {limits.max_message_bytes} bytes")
        if avail < head + size:
            return False
        with memoryview(buf) as view:  # one copy, not a bytearray slice and then bytes
            body = bytes(view[pos + head:pos + head + size])
        self.pos = pos + head + size
        if flags & COMMAND:
            self.command(body)
            return True
        self.parts.append(body)
        self.size += size
        if not flags & MORE:
            message, self.parts, self.size = self.parts, [], 0
            if self.socket_type != SUB or any(message[0].startswith(t) for t in self.topics):
                self.queue.append(message)
                self.wake()
        return True

    def greeting(self, greeting: bytes) -> None:
        if greeting[9] != 0x7F:
            raise ZmtpError("not a ZMTP peer (bad greeting signature)")
        if greeting[10] < 3:
            raise ZmtpError(f"a ZMTP {greeting[10]}.{greeting[11]} peer; 3.x is needed")
        mechanism = greeting[12:32].rstrip(b"\x00")
        if mechanism != b"NULL":
            raise ZmtpError(f"security mechanism {mechanism!r}; only NULL is supported")
        self.state = "ready"
        assert self.transport is not None
        self.transport.write(ready_command(self.socket_type, self.identity))

    def command(self, body: bytes) -> None:
        size = body[0] if body else 0
        if not size or len(body) < 1 + size:
            raise ZmtpError("a malformed command")
        name, data = body[1:1 + size], body[1 + size:]
        if name == b"ERROR":
            reason = data[1:1 + data[0]] if data else b""
            raise ZmtpError(f"the peer refused: {reason.decode('ascii', 'replace')!r}")
        if self.state != "ready":
            return  # PING, SUBSCRIBE...: nothing a 3.0 reader needs (each bounded in size)
        if name != b"READY":
            raise ZmtpError(f"expected READY, got {name[:32]!r}")
        peer = parse_properties(data, self.limits.max_properties).get(b"socket-type", b"")
        if peer not in PEER_TYPES[self.socket_type]:
            raise ZmtpError(f"a {peer[:32]!r} peer cannot talk to a {self.socket_type} socket")
        self.peer_type, self.state = peer.decode(), "traffic"
        assert self.transport is not None
        for topic in self.topics if self.socket_type == SUB else ():
            self.transport.write(frame(b"\x01" + topic))  # ZMTP 3.0 subscription message
        if not self.handshaken.done():
            self.handshaken.set_result(None)

    # ---- ending ----
    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def fail(self, reason: str) -> None:
        """End the connection for ``reason`` (the first reason given is kept)."""
        if self.error is not None:
            return
        self.error = reason
        self.buf, self.pos, self.parts, self.size = bytearray(), 0, [], 0
        if self.transport is not None:
            self.transport.abort()
        if not self.handshaken.done():
            self.handshaken.set_result(reason)
        self.wake()


class ZmtpConnection:
    """One handshaken connection (from :func:`connect`); see the module for its contract."""

    def __init__(self, endpoint: str, protocol: _Protocol) -> None:
        self.endpoint = endpoint
        self._p = protocol

    @property
    def peer_type(self) -> str:
        return self._p.peer_type

    def ready(self) -> bool:
        """True if ``recv_multipart`` would return at once with a message."""
        return bool(self._p.queue)

    def buffered(self) -> tuple[int, int]:
        """(complete messages held, bytes held in the read buffer and the partial message)."""
        p = self._p
        return len(p.queue), len(p.buf) - p.pos + p.size

    async def recv_multipart(self) -> list[bytes]:
        """The next complete message; ``ZmtpError`` once the connection is over. Cancelling
        a waiting call loses nothing."""
        p = self._p
        while not p.queue:
            if p.error is not None:
                raise ZmtpError(p.error)
            p.waiter = p.loop.create_future()
            try:
                await p.waiter
            finally:
                p.waiter = None
        message = p.queue.popleft()
        if not p.scheduled:
            p.pump()  # parse what waits in the buffer; resumes reading if the queue had filled
        return message

    def send_multipart(self, frames: Sequence[bytes]) -> None:
        """Queue one message for the peer (small requests only: no flow control)."""
        p = self._p
        if p.error is not None or p.transport is None:
            raise ZmtpError(p.error or "the connection is closed")
        last = len(frames) - 1
        p.transport.write(b"".join(frame(f, MORE if i < last else 0)
                                   for i, f in enumerate(frames)))

    def close(self) -> None:
        """Drop the connection at once (nothing lingers) and what it holds; later receives
        raise."""
        self._p.fail("closed by the router")
        self._p.queue.clear()


async def connect(endpoint: str, socket_type: str, limits: ZmtpLimits | None = None, *,
                  subscribe: Sequence[bytes] = (), identity: bytes | None = None
                  ) -> ZmtpConnection:
    """Dial ``endpoint`` as a ``socket_type`` (``SUB`` or ``DEALER``) socket and handshake;
    a SUB subscribes to ``subscribe`` (prefixes; ``b""`` for all). See the module."""
    if socket_type not in PEER_TYPES:
        raise ValueError(f"socket type {socket_type!r}: {SUB} or {DEALER}")
    limits = limits or ZmtpLimits()
    host, port = split_endpoint(endpoint)
    protocol = _Protocol(socket_type, limits, subscribe, identity)
    done = False
    try:
        async with asyncio.timeout(limits.handshake_timeout_s):
            await protocol.loop.create_connection(lambda: protocol, host, port)
            reason = await protocol.handshaken
        done = reason is None
    except TimeoutError:
        raise ZmtpError(f"no ZMTP handshake with {endpoint} within "
                        f"{limits.handshake_timeout_s:g} s") from None
    except socket.gaierror:
        raise
    except OSError as exc:
        raise ZmtpError(f"cannot connect to {endpoint}: {exc}") from None
    finally:
        if not done:
            protocol.fail("the handshake did not complete")
    if reason is not None:
        raise ZmtpError(f"{endpoint}: {reason}")
    return ZmtpConnection(endpoint, protocol)
