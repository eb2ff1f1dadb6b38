"""The emulator's runtime-load feed, published as SGLang 0.5.23's scheduler publishes it.

``--load-publish-endpoint`` (with ``--kv-events-config``): one PUB socket bound on the resolved
base port (the emulator is one DP rank), frames ``[b"load", seq, LoadStat]`` (wire format in
``omniinfer.load_feed_wire``). The engine calls :meth:`LoadPublisher.after_pass` after every pass:
a prefill pass publishes, a decode pass every ``decode_interval``-th time. A watcher task covers
what passes do not: between passes (work waiting with none running, or idle) it publishes a
changed reading within ``STALL_REFRESH_S``; an unchanged one is sent again once per
``HEARTBEAT_S``. During a pass nothing is published, as a scheduler busy with a batch does not.
Sending never blocks the engine (high-water mark 8, as SGLang's socket; over it a message is
dropped and counted).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

import zmq

from omniinfer.kv_event_wire import seq_bytes
from omniinfer.load_feed_wire import (
    DECODE_PUBLISH_INTERVAL,
    HEARTBEAT_S,
    LOAD_TOPIC,
    STALL_REFRESH_S,
    LoadStat,
    encode_load,
)

SEND_HWM = 8


class LoadPublisher:
    """PUB socket of one emulated rank; ``snapshot`` reads the engine's load now."""

    def __init__(self, host: str, port: int, snapshot: Callable[[], LoadStat],
                 passing: Callable[[], bool] = lambda: False,
                 decode_interval: int = DECODE_PUBLISH_INTERVAL,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if decode_interval < 1:
            raise ValueError("--load-snapshot-publish-interval must be >= 1")
        self.endpoint = f"tcp://{host}:{port}"
        self.snapshot = snapshot
        self.passing = passing
        self.decode_interval = decode_interval
        self.clock = clock
        self.next_seq = 0
        self.dropped = 0
        self._decode_passes = 0
        self._last: LoadStat | None = None
        self._last_sent_at = 0.0
        self._ctx = zmq.Context()
        self._pub: zmq.Socket[Any] | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Bind the socket and start the watcher; ``OSError`` naming the endpoint on failure."""
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, SEND_HWM)
        pub.setsockopt(zmq.LINGER, 0)
        try:
            pub.bind(self.endpoint)
        except zmq.ZMQError as exc:
            pub.close()
            raise OSError(f"load feed: cannot bind {self.endpoint}: {exc}") from None
        self._pub = pub
        self._task = asyncio.get_running_loop().create_task(self._watch())

    def after_pass(self, kind: str) -> None:
        """The engine finished a ``"prefill"`` or ``"decode"`` pass."""
        if kind == "decode":
            self._decode_passes += 1
            if self._decode_passes % self.decode_interval:
                return
        self.publish()

    def publish(self, force: bool = False) -> bool:
        """Send the reading now unless it equals the last one sent less than a heartbeat ago."""
        stat = self.snapshot()
        now = self.clock()
        if not force and stat == self._last and now - self._last_sent_at < HEARTBEAT_S:
            return False
        if self._pub is None:
            return False
        frames = (LOAD_TOPIC.encode(), seq_bytes(self.next_seq), encode_load(stat))
        self.next_seq += 1
        self._last, self._last_sent_at = stat, now
        try:
            self._pub.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1
        return True

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(STALL_REFRESH_S)
            if not self.passing():  # during a pass the scheduler publishes nothing
                self.publish()

    def describe(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint, "topic": LOAD_TOPIC, "next_seq": self.next_seq,
                "dropped": self.dropped, "decode_interval": self.decode_interval}

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._pub is not None:
            self._pub.close(linger=0)
            self._pub = None
        self._ctx.term()
