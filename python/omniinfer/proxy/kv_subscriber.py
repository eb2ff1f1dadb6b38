"""``--cache-truth kv-events``: subscribe to each worker's KV events and let them drive its index.

Per worker the router finds the publisher in ``/server_info`` (SGLang's ``kv_events`` block, else
its ``kv_events_config`` endpoint with the worker's host for a wildcard; one endpoint per DP
rank) or takes ``--kv-events-endpoint URL=tcp://HOST:PORT``. One asyncio task per endpoint
reads ``[topic, seq, payload]`` messages on a ZMQ SUB socket and applies them in order to the
worker's ``WorkerCacheTruth`` (``cache_truth.py``). A sequence gap is filled from the replay
socket when the worker advertises one; otherwise (or if the replay falls short) that publisher's
pages are forgotten — the router then under-predicts until the worker stores again, which is
safer than predicting what may be gone. A lost connection (the worker died or restarted, or the
network dropped) forgets them too and resynchronises like a late joiner: the first batch after
it that is not sequence 0 asks the replay socket for 0 onwards. A sequence that goes back
without a disconnect is a restart, handled the same way. A worker without events keeps the
router's own index (insert on route), with a warning. The router's hot path never waits on any
of this.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from omniinfer.kv_events import (
    END_OF_REPLAY,
    WILDCARD_HOSTS,
    ProtocolError,
    decode_batch,
    dial_endpoint,
    offset_port,
    parse_kv_events_config,
    seq_bytes,
    seq_from,
    split_tcp,
)
from omniinfer.net import is_loopback
from omniinfer.proxy.cache_truth import SequenceCheck, WorkerCacheTruth
from omniinfer.proxy.prefix import PrefixIndex
from omniinfer.proxy.subscriptions import WorkerSubscriptions
from omniinfer.proxy.workers import Role, Worker

log = logging.getLogger("omniinfer.proxy")
MODES = ("router", "kv-events")
REPLAY_TIMEOUT_S = 2.0
DRAIN_BATCHES = 64
FetchJson = Callable[[Worker, str, float], Awaitable[Any]]


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
    connected: bool = False
    disconnects: int = 0
    last_batch_at: float | None = None

    def describe(self) -> dict[str, Any]:
        age = None if self.last_batch_at is None else round(time.time() - self.last_batch_at, 3)
        return {"endpoint": self.endpoint, "topic": self.topic, "replay": self.replay,
                "connected": self.connected, "disconnects": self.disconnects,
                "last_seq": self.last_seq, "gaps": self.gaps, "restarts": self.restarts,
                "replays": self.replays, "malformed": self.malformed, "last_batch_age_s": age}


def _ranks(value: Any, max_ranks: int) -> int:
    if value is None:
        return 1
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= max_ranks:
        raise NoEvents(f"dp_size {value!r} is not within 1..{max_ranks} "
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
        raise NoEvents(f"endpoint host {host!r} is not the worker's host {worker_host!r}")
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


class WorkerSubscription:
    """The subscriber tasks of one worker (one per publisher)."""

    def __init__(self, worker: Worker, truth: WorkerCacheTruth, sources: list[Source],
                 page_size: int | None, ctx: zmq.asyncio.Context) -> None:
        self.worker = worker
        self.truth = truth
        self.sources = sources
        self.page_size = page_size
        self._ctx = ctx
        self._tasks = [asyncio.get_running_loop().create_task(self._run(i))
                       for i in range(len(sources))]

    def cancel(self) -> None:
        for task in self._tasks:
            task.cancel()

    async def close(self) -> None:
        self.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self, index: int) -> None:
        source = self.sources[index]
        while True:
            sock = self._ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 100_000)
            sock.subscribe(source.topic.encode())
            monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
            sock.connect(source.endpoint)
            poller = zmq.asyncio.Poller()
            poller.register(sock, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            check = SequenceCheck()
            try:
                while True:
                    ready = dict(await poller.poll())
                    if monitor in ready:  # first: a disconnect precedes what comes after it
                        self._connection(index, source, check,
                                         parse_monitor_message(await monitor.recv_multipart()))
                    if sock in ready:
                        await self._drain(index, source, check, sock, monitor)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug or a broken socket: start over from nothing
                log.exception("kv events %s: subscriber failed; re-subscribing", source.endpoint)
                self.truth.reset(index)
                await asyncio.sleep(1.0)
            finally:
                source.connected = False
                sock.disable_monitor()
                monitor.close(linger=0)
                sock.close(linger=0)

    async def _drain(self, index: int, source: Source, check: SequenceCheck,
                     sock: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket) -> None:
        """Apply the batches already queued (up to ``DRAIN_BATCHES``) in one wake-up: under
        load a poll per batch cost more than the batch. Stops early if the monitor has news,
        so a disconnect is still seen before what follows it."""
        for _ in range(DRAIN_BATCHES):
            await self._handle(index, source, check, await sock.recv_multipart())
            if monitor.get(zmq.EVENTS) & zmq.POLLIN or not sock.get(zmq.EVENTS) & zmq.POLLIN:
                return

    def _connection(self, index: int, source: Source, check: SequenceCheck,
                    event: dict[str, Any]) -> None:
        if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            source.connected = True
            log.info("kv events %s: connected", source.endpoint)
        elif event["event"] == zmq.EVENT_DISCONNECTED:
            source.connected = False
            source.disconnects += 1
            source.last_seq = None
            check.expected = None  # what comes next is read like a late join
            self.truth.reset(index)
            log.warning("kv events %s: connection lost; forgetting this publisher's pages until "
                        "it is back", source.endpoint)

    async def _handle(self, index: int, source: Source, check: SequenceCheck,
                      frames: list[bytes]) -> None:
        try:
            if len(frames) != 3:
                raise ProtocolError(f"{len(frames)} frames, expected topic, sequence, payload")
            seq = seq_from(frames[1])
        except ProtocolError as exc:
            source.malformed += 1
            log.warning("kv events %s: malformed message: %s; forgetting this publisher's "
                        "pages", source.endpoint, exc)
            self.truth.reset(index)  # what it lost is unknown: predict nothing rather than stale
            check.expected = None
            return
        kind = check.classify(seq)
        if kind == "restart":
            source.restarts += 1
            log.warning("kv events %s: publisher restarted (seq %d after %d); forgetting its "
                        "pages", source.endpoint, seq, source.last_seq)
            self.truth.reset(index)
        elif kind == "gap" or (kind == "first" and seq > 0):
            start = check.expected if kind == "gap" else 0
            assert start is not None
            filled = source.replay is not None and await self._replay(index, source, start, seq)
            if kind == "gap" and not filled:
                source.gaps += 1
                log.warning("kv events %s: batches %d..%d lost%s; forgetting this publisher's "
                            "pages", source.endpoint, start, seq - 1,
                            "" if source.replay is None else " and not replayable")
                self.truth.reset(index)
            elif kind == "first" and not filled:
                log.info("kv events %s: joined at seq %d; pages stored earlier stay unknown",
                         source.endpoint, seq)
        self._apply(index, source, seq, frames[2])
        check.accept(seq)

    def _apply(self, index: int, source: Source, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except ProtocolError as exc:
            source.malformed += 1
            log.warning("kv events %s: undecodable batch %d: %s; forgetting this publisher's "
                        "pages", source.endpoint, seq, exc)
            self.truth.reset(index)  # its stores and removals are lost: nothing stale stays
            source.last_seq = seq
            return
        self.truth.apply(index, batch)
        source.last_seq = seq
        source.last_batch_at = time.time()

    async def _replay(self, index: int, source: Source, start: int, stop: int) -> bool:
        """Apply batches ``start``..``stop - 1`` from the replay socket; False if it fell short."""
        assert source.replay is not None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(source.replay)
        got: dict[int, bytes] = {}
        try:
            await sock.send_multipart((b"", seq_bytes(start)))
            deadline = time.monotonic() + REPLAY_TIMEOUT_S
            while True:
                frames = await asyncio.wait_for(sock.recv_multipart(),
                                                max(0.01, deadline - time.monotonic()))
                if len(frames) != 4:
                    return False
                seq = seq_from(frames[2])
                if seq == END_OF_REPLAY:
                    break
                if start <= seq < stop:
                    got[seq] = frames[3]
        except (asyncio.TimeoutError, ProtocolError, zmq.ZMQError) as exc:
            log.warning("kv events %s: replay failed: %s", source.replay, exc or "timeout")
            return False
        finally:
            sock.close(linger=0)
        complete = start == 0 or sorted(got) == list(range(start, stop))
        if complete:
            for seq in sorted(got):
                self._apply(index, source, seq, got[seq])
            source.replays += 1  # counted once applied: a status reader sees its effect
        return complete

    def describe(self) -> dict[str, Any]:
        return {"cache_truth": "kv-events", "worker_page_size": self.page_size,
                "sources": [s.describe() for s in self.sources], **self.truth.describe()}


class CacheTruth:
    """Which workers' indexes follow KV events, and their subscriptions."""

    def __init__(self, mode: str, block_size: int, indexes: dict[Role, PrefixIndex],
                 fetch_json: FetchJson, explicit: dict[str, list[str]] | None = None,
                 max_ranks: int = 64, max_pages: int = 1 << 22) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown cache truth {mode!r}: {' or '.join(MODES)}")
        self.mode = mode
        self.block_size = block_size
        self.indexes = indexes
        self.fetch_json = fetch_json
        self.explicit = explicit or {}
        self.max_ranks = max_ranks
        self.max_pages = max_pages
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
                                 self.max_pages)
        self.subs.add(worker.url, WorkerSubscription(worker, truth, sources, page_size,
                                                     self.subs.context()))
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
    from omniinfer.kv_events import split_tcp
    from omniinfer.proxy.workers import normalize_url

    out: dict[str, list[str]] = {}
    for entry in entries:
        url, sep, endpoint = entry.rpartition("=")
        if not sep or not url:
            raise ValueError(f"--kv-events-endpoint takes WORKER_URL=tcp://HOST:PORT, got {entry!r}")
        split_tcp(endpoint)
        out.setdefault(normalize_url(url), []).append(endpoint)
    return out
