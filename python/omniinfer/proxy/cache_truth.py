"""``--cache-truth kv-events``: subscribe to each worker's KV events and let them drive its index.

Per worker the router finds the publisher in ``/server_info`` (SGLang's ``kv_events`` block, else
its ``kv_events_config`` endpoint with the worker's host for a wildcard; one endpoint per DP
rank) or takes ``--kv-events-endpoint URL=tcp://HOST:PORT``. One asyncio task per endpoint
reads ``[topic, seq, payload]`` messages as a ZMQ SUB (the router's own ZMTP client,
``zmtp.py``; not libzmq, whose limits bound frames, not messages) and applies them in order to the
worker's ``WorkerCacheTruth`` (``worker_cache_truth.py``). A sequence gap is filled from the replay
socket when the worker advertises one; otherwise (or if the replay falls short) that publisher's
pages are forgotten — the router then under-predicts until the worker stores again, which is
safer than predicting what may be gone. A lost connection (the worker died or restarted, or the
network dropped) forgets them too and resynchronises like a late joiner: the first batch after
it that is not sequence 0 asks the replay socket for 0 onwards. A sequence that goes back
without a disconnect is a restart, handled the same way. A worker without events keeps the
router's own index (insert on route), with a warning. The router's hot path never waits on any
of this.

A publisher is not trusted (``KvLimits`` in ``kv_sources.py``): its connection queues a bounded
number of messages bounded in frames and bytes (a larger one, or a protocol fault, drops the
connection; the reader then forgets and dials again), one wake-up applies a bounded number of
batches before yielding, a replay is bounded in time, entries and bytes, and a failed replay is
not retried within its timeout. A message that is not ``[topic, seq, payload]`` is counted and dropped
without touching the sequence state; an undecodable payload forgets that publisher's pages.
Warnings are rate-limited per publisher and kind. A reader that fails is logged, counted,
reported (``on_failure``) and restarted; it never dies silently.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from omniinfer.kv_event_wire import ProtocolError, decode_batch, seq_from
from omniinfer.proxy import zmtp
from omniinfer.proxy.control import FailureHook, OwnedTasks, Supervisor, WarningLimiter
from omniinfer.proxy.kv_sources import (
    KvLimits,
    NoEvents,
    ReplayError,
    Source,
    dial_rank,
    fetch_replay,
    sources_from_server_info,
)
from omniinfer.proxy.prefix import PrefixIndex
from omniinfer.proxy.subscriptions import WorkerSubscriptions
from omniinfer.proxy.worker_cache_truth import (
    DEFAULT_MAX_PAGE_TOKENS,
    DEFAULT_MAX_TOKENS,
    SequenceCheck,
    WorkerCacheTruth,
)
from omniinfer.proxy.workers import Role, Worker

__all__ = ["MODES", "CacheTruth", "KvLimits", "NoEvents", "Source", "WorkerSubscription",
           "dial_rank", "parse_endpoint_overrides", "sources_from_server_info"]
log = logging.getLogger("omniinfer.proxy")
MODES = ("router", "kv-events")
FetchJson = Callable[[Worker, str, float], Awaitable[Any]]
APPLY_SLICE = 1024  # events of one batch applied between two yields (~10 ms at most)
DECODE_INLINE_BYTES = 128 << 10  # larger payloads are decoded off the event loop's thread
_WARNINGS = WarningLimiter()  # per publisher endpoint and kind of fault


def _warn(source: Source, kind: str, message: str, *args: Any,
          level: int = logging.WARNING) -> None:
    """Log a fault of ``source`` (what it sent, or its connection), rate-limited."""
    _WARNINGS.warn(log, f"{kind} {source.endpoint}", message, *args, level=level)


class WorkerSubscription(OwnedTasks):
    """The subscriber tasks of one worker (one per publisher).

    Each task reads its publisher within ``limits`` (``KvLimits``) and never dies: a failure is
    logged with its traceback, counted (``Source.failures``), reported to ``on_failure`` (with
    ``"kv-events"``), forgets that publisher's pages and starts over after a backoff. Warnings
    about what a publisher sends are rate-limited per publisher and kind."""

    def __init__(self, worker: Worker, truth: WorkerCacheTruth, sources: list[Source],
                 page_size: int | None,
                 limits: KvLimits | None = None, on_failure: FailureHook | None = None) -> None:
        self.worker = worker
        self.truth = truth
        self.sources = sources
        self.page_size = page_size
        self.limits = limits or KvLimits()
        self._supervisor = Supervisor("kv-events", on_failure, self.limits.restart_backoff_s,
                                      limiter=_WARNINGS)
        self._replay_after = [0.0] * len(sources)  # monotonic: no replay before, after a failed one
        loop = asyncio.get_running_loop()
        self._tasks = [self._supervisor.watch(loop.create_task(self._run(i)), s.endpoint)
                       for i, s in enumerate(sources)]

    async def _run(self, index: int) -> None:
        source = self.sources[index]

        def failed() -> None:
            source.failures += 1
            self.truth.reset(index)  # what it missed meanwhile is unknown: start from nothing

        await self._supervisor.run(source.endpoint, lambda: self._session(index, source), failed)

    async def _session(self, index: int, source: Source) -> None:
        """Read one connection to a publisher until cancelled, until it ends (then return: the
        supervisor dials again) or until something raises. The router's own ZMTP client
        (``zmtp.py``) reads it: every message is bounded in frames and bytes."""
        try:
            conn = await zmtp.connect(source.endpoint, zmtp.SUB, self.limits.connection_limits(),
                                      subscribe=(source.topic.encode(),))
        except zmtp.ZmtpError as exc:  # not up (yet), or not a ZMTP publisher
            _warn(source, "unreachable", "kv events %s: %s", source.endpoint, exc,
                  level=logging.INFO)
            return
        source.connected = True
        _warn(source, "connected", "kv events %s: connected", source.endpoint, level=logging.INFO)
        check = SequenceCheck()
        try:
            while True:
                await self._drain(index, source, check, conn)
                await asyncio.sleep(0)  # a flooding publisher must not hold the event loop
        except zmtp.ZmtpError as exc:
            self._lost(index, source, exc)
        finally:
            source.connected = False
            conn.close()

    async def _drain(self, index: int, source: Source, check: SequenceCheck,
                     sock: zmtp.ZmtpConnection) -> None:
        """Apply the batches already queued (up to ``drain_batches`` or ``drain_bytes``) in one
        wake-up: under load a wait per batch cost more than the batch. Waits for the first; a
        lost connection raises ``ZmtpError`` once the batches that came before it are applied."""
        size = 0
        for _ in range(self.limits.drain_batches):
            frames = await sock.recv_multipart()
            size += sum(map(len, frames))
            await self._handle(index, source, check, frames)
            if size >= self.limits.drain_bytes or not sock.ready():
                return

    def _lost(self, index: int, source: Source, reason: Exception) -> None:
        """The connection ended (the worker died or restarted, the network dropped, or it broke
        the protocol or a bound): forget its pages; the next session reads like a late join."""
        source.connected = False
        source.disconnects += 1
        source.last_seq = None
        self.truth.reset(index)
        _warn(source, "disconnected", "kv events %s: connection lost (%s); forgetting this "
              "publisher's pages until it is back", source.endpoint, reason)

    async def _handle(self, index: int, source: Source, check: SequenceCheck,
                      frames: list[bytes]) -> None:
        try:
            if len(frames) != 3:
                raise ProtocolError(f"{len(frames)} frames, expected topic, sequence, payload")
            seq = seq_from(frames[1])
        except ProtocolError as exc:
            # Not a batch at all: nothing in sequence was lost by it, so the sequence state and
            # the pages stay; if it hid a real batch, the next one shows the gap.
            source.malformed += 1
            _warn(source, "malformed", "kv events %s: malformed message dropped: %s",
                       source.endpoint, exc)
            return
        kind = check.classify(seq)
        if kind == "restart":
            source.restarts += 1
            _warn(source, "restart", "kv events %s: publisher restarted (seq %d after %s); "
                       "forgetting its pages", source.endpoint, seq, source.last_seq)
            self.truth.reset(index)
        elif kind == "gap" or (kind == "first" and seq > 0):
            start = check.expected if kind == "gap" else 0
            assert start is not None
            filled = await self._replay(index, source, start, seq)
            if kind == "gap" and not filled:
                source.gaps += 1
                _warn(source, "gap", "kv events %s: batches %d..%d lost%s; forgetting this "
                           "publisher's pages", source.endpoint, start, seq - 1,
                           "" if source.replay is None else " and not replayed")
                self.truth.reset(index)
            elif kind == "first" and not filled:
                _warn(source, "joined", "kv events %s: joined at seq %d; pages stored "
                           "earlier stay unknown", source.endpoint, seq, level=logging.INFO)
        await self._apply(index, source, seq, frames[2])
        check.accept(seq)

    async def _apply(self, index: int, source: Source, seq: int, payload: bytes) -> None:
        """Decode and apply one batch. A payload over ``DECODE_INLINE_BYTES`` is decoded on a
        worker thread, and a batch of more than ``APPLY_SLICE`` events applied in slices with a
        yield between them (4 MiB of 1-token events held the loop ~0.5 s)."""
        try:
            batch = (decode_batch(payload) if len(payload) <= DECODE_INLINE_BYTES
                     else await asyncio.to_thread(decode_batch, payload))
        except ProtocolError as exc:
            source.malformed += 1
            _warn(source, "undecodable", "kv events %s: undecodable batch %d: %s; "
                       "forgetting this publisher's pages", source.endpoint, seq, exc)
            self.truth.reset(index)  # its stores and removals are lost: nothing stale stays
            source.last_seq = seq
            return
        events = batch.events
        if len(events) <= APPLY_SLICE:
            self.truth.apply(index, batch)
        else:
            for start in range(0, len(events), APPLY_SLICE):
                if start:
                    await asyncio.sleep(0)
                self.truth.apply(index, dataclasses.replace(
                    batch, events=events[start:start + APPLY_SLICE]), first_part=not start)
        source.last_seq = seq
        source.last_batch_at = time.time()

    async def _replay(self, index: int, source: Source, start: int, stop: int) -> bool:
        """Apply batches ``start``..``stop - 1`` from the replay socket; False if there is none,
        if it fell short, within ``replay_timeout_s`` of a failed one, or while the last
        replay's bytes are still being paid for at ``replay_bytes_per_s`` (a publisher that
        gaps on every batch must not cost a replay each). Yields every ``drain_batches``
        batches or ``drain_bytes`` bytes, as the live reader does."""
        if source.replay is None or time.monotonic() < self._replay_after[index]:
            return False
        try:
            got = await fetch_replay(source.replay, start, stop, self.limits)
        except ReplayError as exc:
            source.replay_failures += 1
            self._replay_after[index] = time.monotonic() + self.limits.replay_timeout_s
            _warn(source, "replay", "kv events %s: replay failed: %s", source.replay, exc)
            return False
        if start > 0 and len(got) != stop - start:  # keys are unique and in range
            source.replay_failures += 1
            return False
        total = since = 0
        for i, seq in enumerate(sorted(got)):
            await self._apply(index, source, seq, got[seq])
            total += len(got[seq])
            since += len(got[seq])
            if since >= self.limits.drain_bytes or (i + 1) % self.limits.drain_batches == 0:
                since = 0
                await asyncio.sleep(0)
        self._replay_after[index] = time.monotonic() + total / self.limits.replay_bytes_per_s
        source.replays += 1  # counted once applied: a status reader sees its effect
        return True

    def describe(self) -> dict[str, Any]:
        return {"cache_truth": "kv-events", "worker_page_size": self.page_size,
                "sources": [s.describe() for s in self.sources], **self.truth.describe()}


class CacheTruth:
    """Which workers' indexes follow KV events, and their subscriptions.

    Bounds per worker: ``max_pages`` per publisher (past it that publisher's view is reset),
    ``max_tokens`` over all its publishers (past it the oldest stores are forgotten first),
    ``max_page_tokens`` per page (longer pages are refused) and ``limits`` per publisher
    (``KvLimits``). ``on_failure`` hears ``"kv-events"`` each time a reader fails."""

    def __init__(self, mode: str, block_size: int, indexes: dict[Role, PrefixIndex],
                 fetch_json: FetchJson, explicit: dict[str, list[str]] | None = None,
                 max_ranks: int = 64, max_pages: int = 1 << 22, *,
                 max_tokens: int = DEFAULT_MAX_TOKENS,
                 max_page_tokens: int = DEFAULT_MAX_PAGE_TOKENS,
                 limits: KvLimits | None = None, on_failure: FailureHook | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown cache truth {mode!r}: {' or '.join(MODES)}")
        self.mode = mode
        self.block_size = block_size
        self.indexes = indexes
        self.fetch_json = fetch_json
        self.explicit = explicit or {}
        self.max_ranks = max_ranks
        self.max_pages = max_pages
        self.max_tokens = max_tokens
        self.max_page_tokens = max_page_tokens
        self.limits = limits or KvLimits()
        self.on_failure = on_failure
        self.subs: WorkerSubscriptions[WorkerSubscription] = WorkerSubscriptions(mode)

    @property
    def enabled(self) -> bool:
        return self.mode == "kv-events"

    def follows(self, worker: Worker) -> bool:
        """True if events, not routing, fill this worker's index."""
        return worker.url in self.subs

    def label(self, worker: Worker) -> str:
        return "kv-events" if worker.url in self.subs else "router"

    async def attach(self, worker: Worker) -> None:
        """Subscribe to ``worker``'s events (kv-events mode); else keep the router's index."""
        if not self.enabled or worker.url in self.subs:
            return
        try:
            if worker.url in self.explicit:
                sources = [Source(e) for e in self.explicit[worker.url]]
                page_size = None
            else:
                info = await self.fetch_json(worker, "/server_info", 10.0)
                sources, page_size = sources_from_server_info(info, worker.host, self.max_ranks)
            if worker.url in self.subs:  # attached meanwhile
                return
        except Exception as exc:  # noqa: BLE001 - a bad publisher never stops the router
            if not isinstance(exc, NoEvents):
                exc = NoEvents(f"unusable /server_info: {exc.__class__.__name__}: {exc}")
            self.subs.refuse(worker.url, str(exc),
                             "cache truth: %s: %s; using the router's own index for it")
            return
        index = self.indexes[worker.role]
        index.clear(worker.url)  # from now on only the worker's events fill it
        truth = WorkerCacheTruth(worker.url, index, self.block_size, len(sources),
                                 self.max_pages, max_tokens=self.max_tokens,
                                 max_page_tokens=self.max_page_tokens)
        self.subs.add(worker.url, WorkerSubscription(worker, truth, sources, page_size,
                                                     self.limits,
                                                     self.on_failure))
        log.info("cache truth: %s follows KV events from %s (worker page %s, router block %d)",
                 worker.url, ", ".join(s.endpoint for s in sources), page_size or "?",
                 self.block_size)

    def detach(self, worker: Worker) -> None:
        """Stop following ``worker`` now: its tasks apply nothing more (they close on their own)."""
        self.subs.detach(worker.url)

    def expect(self, worker: Worker, hashes: Sequence[int]) -> None:
        """A prompt was sent to ``worker``: its blocks count as held there until the worker's
        events report them or a deadline passes (events come only once the prefill is done)."""
        sub = self.subs.get(worker.url)
        if sub is not None:
            sub.truth.expect(hashes, time.monotonic())

    def forget(self, worker: Worker) -> None:
        """The worker's cache may be gone (re-admitted, flushed): drop what its events said."""
        sub = self.subs.get(worker.url)
        if sub is not None:
            sub.truth.reset()

    async def close(self) -> None:
        await self.subs.close()

    def describe(self) -> dict[str, Any]:
        return self.subs.describe_workers("cache_truth", "router")


def parse_endpoint_overrides(entries: list[str]) -> dict[str, list[str]]:
    """``URL=tcp://HOST:PORT`` entries (repeat a URL for its DP ranks, in rank order)."""
    from omniinfer.kv_event_wire import split_tcp
    from omniinfer.proxy.workers import normalize_url

    out: dict[str, list[str]] = {}
    for entry in entries:
        url, sep, endpoint = entry.rpartition("=")
        if not sep or not url:
            raise ValueError(f"--kv-events-endpoint takes WORKER_URL=tcp://HOST:PORT, got {entry!r}")
        split_tcp(endpoint)
        out.setdefault(normalize_url(url), []).append(endpoint)
    return out
