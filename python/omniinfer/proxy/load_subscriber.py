"""``--load-feed auto``: read each worker's own load from SGLang's load feed instead of polling.

A worker started with ``--load-publish-endpoint`` (beside ``--kv-events-config``) advertises its
feed in ``/server_info`` (``kv_events.load_endpoint_port_base`` and ``load_topic``; one PUB
socket per DP rank on base + rank; wire format in ``omniinfer.load_feed_wire``). Per such
worker the router keeps one SUB socket per rank, dialled on the worker's own host only. Every
reading replaces that rank's part of ``worker.loads`` at once, and the policy hears of it
(``on_loads``), so the router sees a prefill batch's effect when the batch ends rather than at
the next poll. Contracts:

- A worker's feed is *live* while every rank was heard within ``STALE_AFTER_S`` (SGLang sends a
  heartbeat each second). While live, the poll of ``/v1/loads`` skips the worker; once stale
  (the worker died, restarted on other ports, or the network dropped) the poll serves it again,
  and the feed takes over again by itself when readings resume.
- A worker that advertises no feed, or an unusable one (too many ranks, another host, bad
  ports), is polled, with one warning naming the reason; the router never fails for it.
- Figures the feed does not carry (``gen_throughput``) keep their last polled value.
- Messages that do not decode are counted and skipped (warnings rate-limited per rank); the
  router's hot path never waits on a socket.
- A worker is not trusted: each SUB connection (the router's own ZMTP client, ``zmtp.py``)
  holds at most ``QUEUE_MESSAGES`` readings of at most ``MAX_MESSAGE_BYTES`` in all their
  frames (a larger one ends the connection, which is dialled again); one wake-up reads at most
  ``DRAIN_READINGS`` queued readings (the newest counts) and then yields to the event loop, so
  a flood cannot stall the router; every figure is clamped (``load_count`` / ``load_rate``) as
  a polled one is. A reader that fails is logged with its traceback, counted
  (``RankFeed.failures``), reported to ``on_failure`` (``"load-feed"``) and restarted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import reprlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

from omniinfer.kv_event_wire import ProtocolError, seq_from
from omniinfer.load_feed_wire import STALE_AFTER_S, LoadStat, decode_load
from omniinfer.proxy import zmtp
from omniinfer.proxy.control import FailureHook, OwnedTasks, Supervisor, WarningLimiter
from omniinfer.proxy.kv_sources import NoEvents, dial_rank
from omniinfer.proxy.subscriptions import WorkerSubscriptions
from omniinfer.proxy.workers import (
    MAX_LOAD_COUNT,
    RankLoad,
    Worker,
    WorkerLoads,
    load_count,
    load_rate,
)

log = logging.getLogger("omniinfer.proxy")
MODES = ("auto", "off")
MAX_MESSAGE_BYTES = 64 << 10  # a reading is about 60 bytes
QUEUE_MESSAGES = 16  # only the newest reading counts
DRAIN_READINGS = 64  # read per wake-up before yielding to the event loop
RESUBSCRIBE_AFTER_S = 2 * STALE_AFTER_S  # a rank silent this long gets a fresh socket
FetchJson = Callable[[Worker, str, float], Awaitable[Any]]


class NoFeed(Exception):
    """This worker advertises no usable load feed (the reason is the message)."""


def feed_endpoints(info: Any, worker_host: str, max_ranks: int = 64) -> tuple[list[str], str]:
    """The load-feed endpoints (one per DP rank) and topic a ``/server_info`` answer advertises,
    dialled on ``worker_host``; ``NoFeed`` naming the reason otherwise."""
    block = info.get("kv_events") if isinstance(info, dict) else None
    if not isinstance(block, dict):
        raise NoFeed("it publishes no KV events, so no load feed (--kv-events-config and "
                     "--load-publish-endpoint)")
    base = block.get("load_endpoint_port_base")
    if not isinstance(base, int) or isinstance(base, bool):
        raise NoFeed("it advertises no load feed (start it with --load-publish-endpoint auto)")
    ranks = block.get("dp_size", 1)
    if not isinstance(ranks, int) or isinstance(ranks, bool) or not 1 <= ranks <= max_ranks:
        raise NoFeed(f"dp_size {reprlib.repr(ranks)} is not within 1..{max_ranks}")
    host = str(block.get("endpoint_host") or "*")
    try:
        endpoints = [dial_rank(f"tcp://{host}:{base}", r, worker_host) for r in range(ranks)]
    except NoEvents as exc:
        raise NoFeed(str(exc)) from None
    return endpoints, str(block.get("load_topic") or "load")


@dataclasses.dataclass
class RankFeed:
    """One rank's socket and what the router last heard on it."""

    endpoint: str
    last: LoadStat | None = None
    heard_at: float = 0.0  # monotonic
    last_seq: int | None = None
    readings: int = 0
    malformed: int = 0
    failures: int = 0  # reader failures (each logged, counted, restarted)

    def describe(self, now: float) -> dict[str, Any]:
        age = None if self.last is None else round(now - self.heard_at, 3)
        return {"endpoint": self.endpoint, "readings": self.readings, "last_seq": self.last_seq,
                "malformed": self.malformed, "failures": self.failures, "age_s": age}


def merged_loads(ranks: list[RankFeed], previous: WorkerLoads) -> WorkerLoads:
    """The worker's loads summed over its ranks' last readings (as ``WorkerLoads.from_json``
    sums /v1/loads entries), each rank's part kept by its position (rank r publishes on base +
    r); ``gen_throughput`` kept from ``previous``. Every figure is clamped
    as a polled one is: each rank's by ``load_count``, each sum to ``MAX_LOAD_COUNT``, usage by
    ``load_rate``; so no reading (2**64 - 1 is valid msgpack) reaches the policies unbounded."""
    loads = WorkerLoads(gen_throughput=previous.gen_throughput, polled_at=time.time())
    usages = []
    for position, rank in enumerate(ranks):
        s = rank.last
        if s is None:
            continue
        used, total = load_count(s.num_tokens), load_count(s.max_total_num_tokens)
        loads.add_rank(position, position, RankLoad(
            used, load_count(s.num_waiting_uncached_tokens), load_count(s.num_running_reqs)))
        loads.running_reqs += load_count(s.num_running_reqs)
        loads.waiting_reqs += load_count(s.num_waiting_reqs)
        loads.waiting_uncached_tokens += load_count(s.num_waiting_uncached_tokens)
        loads.used_tokens += used
        loads.max_total_tokens += total
        loads.max_running_reqs += load_count(s.max_running_requests)
        loads.prefill_busy_us += load_count(s.total_prefill_busy_us)
        loads.prefill_uncached_tokens += load_count(s.total_prefill_uncached_tokens)
        usages.append(load_rate(used / total) if total else 0.0)
    loads.token_usage = max(usages, default=0.0)
    for field in _COUNT_FIELDS:  # sums of bounded ranks stay bounded
        setattr(loads, field, min(getattr(loads, field), MAX_LOAD_COUNT))
    return loads


_COUNT_FIELDS = ("running_reqs", "waiting_reqs", "waiting_uncached_tokens", "used_tokens",
                 "max_total_tokens", "max_running_reqs", "prefill_busy_us",
                 "prefill_uncached_tokens")


class WorkerFeed(OwnedTasks):
    """The subscriber tasks of one worker (one per rank); they never die (see the module)."""

    def __init__(self, worker: Worker, endpoints: list[str], topic: str,
                 on_loads: Callable[[Worker], None],
                 on_failure: FailureHook | None = None, restart_backoff_s: float = 1.0,
                 warn_every_s: float = 10.0) -> None:
        self.worker = worker
        self.topic = topic
        self.ranks = [RankFeed(e) for e in endpoints]
        self._on_loads = on_loads
        self._warnings = WarningLimiter(warn_every_s)
        self._supervisor = Supervisor("load-feed", on_failure, restart_backoff_s,
                                      limiter=self._warnings)
        loop = asyncio.get_running_loop()
        self._tasks = [self._supervisor.watch(loop.create_task(self._run(r)), r.endpoint)
                       for r in self.ranks]

    def live(self, now: float) -> bool:
        return all(r.last is not None and now - r.heard_at <= STALE_AFTER_S for r in self.ranks)

    async def _run(self, rank: RankFeed) -> None:
        def failed() -> None:
            rank.failures += 1

        await self._supervisor.run(rank.endpoint, lambda: self._session(rank), failed)

    async def _session(self, rank: RankFeed) -> None:
        """Read one connection to a rank (the router's own ZMTP client, ``zmtp.py``: messages
        bounded in frames and bytes) until cancelled, until it ends or stays silent for
        ``RESUBSCRIBE_AFTER_S`` (then return: the supervisor dials again) or until something
        raises."""
        limits = zmtp.ZmtpLimits(max_message_bytes=MAX_MESSAGE_BYTES, queue_messages=QUEUE_MESSAGES)
        sock: zmtp.ZmtpConnection | None = None
        try:
            sock = await zmtp.connect(rank.endpoint, zmtp.SUB, limits,
                                      subscribe=(self.topic.encode(),))
            while True:
                try:  # not wait_for: on 3.11 it can swallow a cancel that meets a result
                    async with asyncio.timeout(RESUBSCRIBE_AFTER_S):
                        frames = await sock.recv_multipart()
                except TimeoutError:
                    return  # silent: dial again (a half-open connection is never heard again)
                for _ in range(DRAIN_READINGS - 1):  # only the newest reading counts
                    if not sock.ready():
                        break
                    frames = await sock.recv_multipart()
                self._apply(rank, frames)
                await asyncio.sleep(0)  # a flooding worker must not hold the event loop
        except zmtp.ZmtpError as exc:  # not up (yet), gone, or it broke the protocol or a bound
            self._warnings.warn(log, f"connection {rank.endpoint}", "load feed %s: %s",
                                rank.endpoint, exc, level=logging.INFO)
        finally:
            if sock is not None:
                sock.close()

    def _apply(self, rank: RankFeed, frames: list[bytes]) -> None:
        try:
            if len(frames) != 3:
                raise ProtocolError(f"{len(frames)} frames, expected topic, sequence, payload")
            seq = seq_from(frames[1])
            stat = decode_load(frames[2])
        except ProtocolError as exc:
            rank.malformed += 1
            self._warnings.warn(log, rank.endpoint, "load feed %s: malformed message: %s",
                                rank.endpoint, exc)
            return
        rank.last, rank.heard_at, rank.last_seq = stat, time.monotonic(), seq
        rank.readings += 1
        if self.live(rank.heard_at):
            self.worker.loads = merged_loads(self.ranks, self.worker.loads)
            self._on_loads(self.worker)

    def describe(self) -> dict[str, Any]:
        now = time.monotonic()
        return {"load_source": "feed" if self.live(now) else "poll (feed stale)",
                "ranks": [r.describe(now) for r in self.ranks]}


class LoadFeeds:
    """Which workers' loads come from their feed, and their subscriptions."""

    def __init__(self, mode: str, fetch_json: FetchJson, on_loads: Callable[[Worker], None],
                 max_ranks: int = 64, on_failure: FailureHook | None = None) -> None:
        """``on_failure`` hears ``"load-feed"`` each time a reader fails (e.g. for a metric)."""
        if mode not in MODES:
            raise ValueError(f"unknown load feed mode {mode!r}: {' or '.join(MODES)}")
        self.mode = mode
        self.fetch_json = fetch_json
        self.on_loads = on_loads
        self.max_ranks = max_ranks
        self.on_failure = on_failure
        self.feeds: WorkerSubscriptions[WorkerFeed] = WorkerSubscriptions(mode)

    def live(self, worker: Worker) -> bool:
        """True while the worker's feed is fresh: polling it would only repeat what it said."""
        feed = self.feeds.get(worker.url)
        return feed is not None and feed.live(time.monotonic())

    async def attach(self, worker: Worker) -> None:
        """Subscribe to ``worker``'s feed if it advertises one (mode auto); else keep polling."""
        if self.mode == "off" or worker.url in self.feeds:
            return
        try:
            info = await self.fetch_json(worker, "/server_info", 10.0)
            endpoints, topic = feed_endpoints(info, worker.host, self.max_ranks)
        except Exception as exc:  # noqa: BLE001 - a bad answer never stops the router
            reason = str(exc) if isinstance(exc, NoFeed) else f"unusable /server_info: {exc}"
            self.feeds.refuse(worker.url, reason, "load feed: %s: %s; polling /v1/loads",
                              logging.INFO)
            return
        if worker.url in self.feeds:  # attached meanwhile
            return
        self.feeds.add(worker.url, WorkerFeed(worker, endpoints, topic,
                                              self.on_loads, self.on_failure))
        log.info("load feed: %s publishes its load on %s", worker.url, ", ".join(endpoints))

    def detach(self, worker: Worker) -> None:
        self.feeds.detach(worker.url)

    async def close(self) -> None:
        await self.feeds.close()

    def describe(self) -> dict[str, Any]:
        return self.feeds.describe_workers("load_source", "poll")
