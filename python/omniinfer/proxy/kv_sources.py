"""Where a worker's KV events come from, and how much the router accepts from there.

``sources_from_server_info`` reads the publishers (one per DP rank) a worker's ``/server_info``
advertises, trusting it no further than needed. ``KvLimits`` bounds what one publisher can make
the router hold or do: message size, queued messages, work per event-loop wake-up, and each
replay (deadline, entries, bytes). ``fetch_replay`` asks a replay socket for a range of batches
within those bounds. Used by ``cache_truth.py``; no state of its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import reprlib
import time
from typing import Any

from omniinfer.kv_event_wire import (
    END_OF_REPLAY,
    WILDCARD_HOSTS,
    ProtocolError,
    dial_endpoint,
    offset_port,
    parse_kv_events_config,
    seq_bytes,
    seq_from,
    split_tcp,
)
from omniinfer.net import is_loopback
from omniinfer.proxy import zmtp


class NoEvents(Exception):
    """This worker publishes no usable KV events (the reason is the message)."""


@dataclasses.dataclass
class Source:
    """One publisher (one DP rank) of a worker, and what the router saw of it."""

    endpoint: str
    topic: str = ""
    replay: str | None = None
    last_seq: int | None = None
    gaps: int = 0
    restarts: int = 0
    replays: int = 0  # completed replays (late join, or a gap filled)
    malformed: int = 0
    failures: int = 0  # reader failures (each logged, counted, restarted)
    replay_failures: int = 0
    connected: bool = False
    disconnects: int = 0
    last_batch_at: float | None = None

    def describe(self) -> dict[str, Any]:
        age = None if self.last_batch_at is None else round(time.time() - self.last_batch_at, 3)
        return {"endpoint": self.endpoint, "topic": self.topic, "replay": self.replay,
                "connected": self.connected, "disconnects": self.disconnects,
                "last_seq": self.last_seq, "gaps": self.gaps, "restarts": self.restarts,
                "replays": self.replays, "replay_failures": self.replay_failures,
                "malformed": self.malformed, "failures": self.failures,
                "last_batch_age_s": age}


def _ranks(value: Any, max_ranks: int) -> int:
    if value is None:
        return 1
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= max_ranks:
        raise NoEvents(f"dp_size {reprlib.repr(value)} is not within 1..{max_ranks} "
                       "(--kv-events-max-dp-size)")
    return value


def dial_rank(endpoint: str, rank: int, worker_host: str) -> str:
    """Rank ``rank``'s endpoint, dialled on the worker's own host; NoEvents if it names another
    host or a port out of range (a worker's answer must not point the router elsewhere)."""
    try:
        host, _ = split_tcp(endpoint)
        dialled = dial_endpoint(offset_port(endpoint, rank), worker_host)
    except ValueError as exc:
        raise NoEvents(f"unusable endpoint: {exc}") from None
    bare, own = host.strip("[]"), worker_host.strip("[]")
    if host not in WILDCARD_HOSTS and bare != own and not (is_loopback(bare) and is_loopback(own)):
        raise NoEvents(f"endpoint host {reprlib.repr(host)} is not the worker's host "
                       f"{worker_host!r}")
    return dialled


def sources_from_server_info(info: Any, worker_host: str, max_ranks: int = 64
                             ) -> tuple[list[Source], int | None]:
    """The publishers a worker's ``/server_info`` advertises, and its page size; or NoEvents.

    Trusted no further than needed: at most ``max_ranks`` publishers, valid ports, and only on
    the worker's own host."""
    if not isinstance(info, dict):
        raise NoEvents("no /server_info answer")
    block = info.get("kv_events")
    if isinstance(block, dict) and isinstance(block.get("endpoint_port_base"), int):
        host = str(block.get("endpoint_host") or "*")
        base = block["endpoint_port_base"]
        ranks = _ranks(block.get("dp_size"), max_ranks)
        replay = block.get("replay_endpoint_port_base")
        topic = str(block.get("topic") or "")
        endpoint = f"tcp://{host}:{base}"
        replay_endpoint = f"tcp://{host}:{replay}" if isinstance(replay, int) else None
        size = block.get("block_size")
    else:
        raw = info.get("kv_events_config")
        if not raw:
            raise NoEvents("the worker publishes no KV events (start it with --kv-events-config)")
        try:
            config = parse_kv_events_config(raw)
        except (ValueError, TypeError) as exc:
            raise NoEvents(f"its kv_events_config is unusable: {exc}") from None
        if not config.enabled:
            raise NoEvents("its kv_events_config publisher is 'null'")
        ranks = _ranks(info.get("dp_size"), max_ranks)
        endpoint, replay_endpoint, topic = config.endpoint, config.replay_endpoint, config.topic
        size = info.get("page_size")
    sources = [Source(dial_rank(endpoint, r, worker_host), topic,
                      dial_rank(replay_endpoint, r, worker_host) if replay_endpoint else None)
               for r in range(ranks)]
    return sources, size if isinstance(size, int) and not isinstance(size, bool) else None


@dataclasses.dataclass(frozen=True)
class KvLimits:
    """What one KV-event publisher may cost the router (defaults fit SGLang's own defaults).

    Memory held per connection (``zmtp.py``) is at most ``(queue_messages + 1) *
    max_message_bytes`` plus one read (68 MiB by default, reached only by a peer that
    outpaces the router with maximal messages)."""

    max_message_bytes: int = 4 << 20  # a larger message (all frames) ends the connection
    queue_messages: int = 16  # complete messages held per connection before TCP pushes back
    drain_batches: int = 64  # batches applied per wake-up before yielding to the event loop
    drain_bytes: int = 1 << 20  # and payload bytes (~10 ms of hashing; 8 MiB held the loop)
    replay_timeout_s: float = 2.0  # a replay's whole answer, end marker included
    replay_max_entries: int = 10_000  # SGLang's buffer_steps default
    replay_max_bytes: int = 64 << 20
    replay_bytes_per_s: int = 8 << 20  # after a replay of B bytes, none for B / this seconds
    restart_backoff_s: float = 1.0  # a failed reader's first wait before it starts over

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            if not getattr(self, field.name) > 0:
                raise ValueError(f"KvLimits.{field.name} must be positive")

    def connection_limits(self) -> zmtp.ZmtpLimits:
        """The bounds of each connection to a publisher or replay socket."""
        return zmtp.ZmtpLimits(max_message_bytes=self.max_message_bytes,
                               queue_messages=self.queue_messages)


class ReplayError(Exception):
    """A replay that cannot fill the range asked for (the reason is the message)."""


async def fetch_replay(endpoint: str, start: int, stop: int,
                       limits: KvLimits) -> dict[int, bytes]:
    """The payloads of batches ``start``..``stop - 1`` the replay socket at ``endpoint`` holds.

    Contract: returns once the end marker arrives; raises ``ReplayError`` if the answer is
    malformed, if it has not ended by ``limits.replay_timeout_s`` (from the dial on, checked
    before every receive, so a peer that keeps sending cannot extend it), or if the range or
    the batches kept pass ``replay_max_entries`` / ``replay_max_bytes``. Only batches in the
    range are kept, once each. Yields to the event loop every ``drain_batches`` messages. The
    caller decides whether what came back is complete. Read with the router's own ZMTP client
    (``zmtp.py``, a DEALER): each message is bounded in frames and bytes."""
    if start > 0 and stop - start > limits.replay_max_entries:
        raise ReplayError(f"{stop - start} batches to replay, more than "
                          f"{limits.replay_max_entries}")
    got: dict[int, bytes] = {}
    size = received = 0
    deadline = time.monotonic() + limits.replay_timeout_s
    conn: zmtp.ZmtpConnection | None = None
    try:
        conn = await zmtp.connect(endpoint, zmtp.DEALER, dataclasses.replace(
            limits.connection_limits(), handshake_timeout_s=limits.replay_timeout_s))
        conn.send_multipart((b"", seq_bytes(start)))
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ReplayError(f"no end of replay within {limits.replay_timeout_s:g} s")
            try:  # not wait_for: on 3.11 it can swallow a cancel that meets a result
                async with asyncio.timeout(left):
                    frames = await conn.recv_multipart()
            except TimeoutError:
                raise ReplayError(f"no end of replay within {limits.replay_timeout_s:g} s"
                                  ) from None
            received += 1
            if received % limits.drain_batches == 0:
                await asyncio.sleep(0)
            if len(frames) != 4:
                raise ReplayError(f"an answer of {len(frames)} frames, expected 4")
            try:
                seq = seq_from(frames[2])
            except ProtocolError as exc:
                raise ReplayError(str(exc)) from None
            if seq == END_OF_REPLAY:
                return got
            if start <= seq < stop and seq not in got:
                size += len(frames[3])
                if len(got) >= limits.replay_max_entries or size > limits.replay_max_bytes:
                    raise ReplayError(f"more than {limits.replay_max_entries} batches or "
                                      f"{limits.replay_max_bytes} bytes")
                got[seq] = frames[3]
    except (zmtp.ZmtpError, OSError) as exc:
        raise ReplayError(f"connection: {exc}") from None
    finally:
        if conn is not None:
            conn.close()
