"""The emulator's KV-cache events: what its radix cache stores, evicts and flushes, published the
way SGLang 0.5.23 publishes them (``--kv-events-config``; wire format in
``omniinfer.kv_event_wire``).

The emulated cache is token-granular, like SGLang with page size 1, so every token is one block
and a new radix node is one ``BlockStored`` with one hash per token. Block hashes are opaque
signed 64-bit ids (SGLang's are SHA-256 based; subscribers must not recompute them): here each
is CPython's hash of ``(previous hash, token)``, which is deterministic for integers, so equal
token paths give equal ids across restarts. ``KvEventRecorder`` is pure (the radix cache calls
it); ``ZmqKvEventPublisher`` sends one batch per event-loop tick, numbered from 0, keeps the last
``buffer_steps`` batches for the optional replay socket, and never blocks the engine (a PUB
socket drops at its high-water mark, as SGLang's does).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq
import zmq.asyncio

from omniinfer.kv_event_wire import (
    END_OF_REPLAY,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventsConfig,
    binds,
    encode_batch,
    offset_port,
    seq_bytes,
    seq_from,
    split_tcp,
)

logger = logging.getLogger("omniinfer.emulator")
_ROOT_SEED = 0x5DEECE66D  # the chain's start; the root itself has no hash (parent None)
MEDIUM = "GPU"


def token_hashes(parent: int | None, tokens: Sequence[int]) -> list[int]:
    """One chained id per token: a page of size 1 per token, as SGLang's CPU default."""
    previous = _ROOT_SEED if parent is None else parent
    out = []
    for token in tokens:
        previous = hash((previous, token))
        out.append(previous)
    return out


class KvEventRecorder:
    """Collects the radix cache's events until the publisher takes them (SGLang coalesces the
    same way: consecutive removals become one ``BlockRemoved``)."""

    block_size = 1

    def __init__(self, on_pending: Callable[[], None] | None = None) -> None:
        self._queue: list[Any] = []
        self.on_pending = on_pending

    def _add(self, event: Any) -> None:
        if not self._queue and self.on_pending is not None:
            self.on_pending()
        self._queue.append(event)

    def stored(self, parent: int | None, tokens: Sequence[int]) -> int:
        """A new node with ``tokens`` under the node whose last hash is ``parent``; its last hash."""
        hashes = token_hashes(parent, tokens)
        self._add(BlockStored(block_hashes=hashes, parent_block_hash=parent,
                              token_ids=list(tokens), block_size=self.block_size, lora_id=None,
                              medium=MEDIUM))
        return hashes[-1]

    def removed(self, parent: int | None, tokens: Sequence[int]) -> None:
        hashes = token_hashes(parent, tokens)
        tail = self._queue[-1] if self._queue else None
        if isinstance(tail, BlockRemoved):
            tail.block_hashes.extend(hashes)
        else:
            self._add(BlockRemoved(block_hashes=hashes, medium=MEDIUM))

    def cleared(self) -> None:
        self._add(AllBlocksCleared())

    @staticmethod
    def last_hash(parent: int | None, tokens: Sequence[int]) -> int:
        """The hash of the last token of a node (after a split), without an event."""
        return token_hashes(parent, tokens)[-1]

    def take(self) -> list[Any]:
        events, self._queue = self._queue, []
        return events


class ZmqKvEventPublisher:
    """PUB socket (+ optional replay ROUTER) of one emulated worker; start inside the loop."""

    def __init__(self, config: KvEventsConfig, dp_rank: int = 0) -> None:
        self.config = config
        self.dp_rank = dp_rank
        self.endpoint = offset_port(config.endpoint, dp_rank)
        self.replay_endpoint = (offset_port(config.replay_endpoint, dp_rank)
                                if config.replay_endpoint else None)
        self.recorder = KvEventRecorder(self._schedule)
        self.topic = config.topic.encode()
        self.next_seq = 0
        self.dropped = 0
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(
            maxlen=config.buffer_steps)
        self._ctx = zmq.asyncio.Context()
        self._pub: zmq.Socket[Any] | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self._scheduled = False

    def start(self) -> None:
        """Open the sockets; ``OSError`` naming the endpoint if one cannot be bound."""
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, self.config.hwm)
        pub.setsockopt(zmq.LINGER, 0)
        try:
            if binds(self.config):
                pub.bind(self.endpoint)
            else:
                pub.connect(self.endpoint)
            self._pub = pub
            if self.replay_endpoint is not None:
                replay = self._ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.bind(self.replay_endpoint)
                self._replay = replay
                self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())
        except zmq.ZMQError as exc:
            pub.close()
            self.close_sockets()
            raise OSError(f"kv events: cannot open {self.endpoint}: {exc}") from None

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            with contextlib.suppress(RuntimeError):  # no running loop: flushed on the next call
                asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        """Publish what the cache recorded since the last flush as one batch."""
        self._scheduled = False
        events = self.recorder.take()
        if not events or self._pub is None:
            return
        seq = self.next_seq
        self.next_seq += 1
        payload = encode_batch(time.time(), events, self.dp_rank)
        self._buffer.append((seq, payload))
        try:
            self._pub.send_multipart((self.topic, seq_bytes(seq), payload), flags=zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1  # over the high-water mark: subscribers will see a gap

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3:
                logger.warning("kv events: malformed replay request (%d frames)", len(frames))
                continue
            client, _, start = frames
            try:
                first = seq_from(start)
            except ValueError:
                continue
            for seq, payload in list(self._buffer):
                if seq >= first:
                    await self._replay.send_multipart(
                        (client, b"", self.topic, seq_bytes(seq), payload))
            await self._replay.send_multipart((client, b"", b"", seq_bytes(END_OF_REPLAY), b""))

    def describe(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint,
                "next_seq": self.next_seq, "dropped": self.dropped,
                "buffered": len(self._buffer)}

    def close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None

    async def close(self) -> None:
        self.flush()
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
        self.close_sockets()
        self._ctx.term()


def server_info_block(config: KvEventsConfig | None) -> dict[str, Any] | None:
    """SGLang's /server_info ``kv_events`` block: where and how to subscribe (page size 1)."""
    if config is None or not config.enabled:
        return None
    host, port = split_tcp(config.endpoint)
    out: dict[str, Any] = {"publisher": config.publisher, "endpoint_host": host,
                           "endpoint_port_base": port, "topic": config.topic,
                           "block_size": KvEventRecorder.block_size, "dp_size": 1}
    if config.replay_endpoint:
        out["replay_endpoint_port_base"] = split_tcp(config.replay_endpoint)[1]
    return out
