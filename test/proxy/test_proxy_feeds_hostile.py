"""The router's two ZMQ readers (load feed, KV events) against a hostile worker, over loopback:
floods, malformed framing, a replay that never ends, oversized and deeply nested messages, a
subscriber that fails. Each keeps the event loop responsive, its memory and log bounded, and
keeps applying honest messages afterwards."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from omni_testing import eventually
from omniinfer.child_process import free_port
from omniinfer.kv_event_wire import BlockRemoved, BlockStored, encode_batch, seq_bytes
from omniinfer.load_feed_wire import LoadStat, encode_load
from omniinfer.proxy.cache_truth import KvLimits, Source, WorkerSubscription
from omniinfer.proxy.load_subscriber import WorkerFeed
from omniinfer.proxy.prefix import PrefixIndex
from omniinfer.proxy.worker_cache_truth import RUN_CHARGE, WorkerCacheTruth
from omniinfer.proxy.workers import Role, Worker

PEER = Path(__file__).with_name("hostile_peer.py")
LAG_LIMIT_S = 0.1


def _peer(*args: Any) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, str(PEER), *map(str, args)])


async def _max_lag_while(running: Callable[[], bool], limit_s: float = 15.0) -> float:
    """The longest the event loop was held between the beats of a 10 ms ticker while
    ``running()`` holds, in CPU seconds of this thread: time the OS gave other processes (a
    loaded test machine) is not the reader's doing, and a reader that never yields shows up
    whole."""
    loop = asyncio.get_running_loop()
    worst, end = 0.0, loop.time() + limit_s
    while running() and loop.time() < end:
        before = time.thread_time()
        await asyncio.sleep(0.01)
        worst = max(worst, time.thread_time() - before)
    return worst


def _store(page_hash: int, parent: int | None, tokens: list[int]) -> bytes:
    return encode_batch(0.0, [BlockStored(block_hashes=[page_hash], parent_block_hash=parent,
                                          token_ids=tokens, block_size=len(tokens),
                                          lora_id=None)])


def _subscription(endpoint: str, replay: str | None = None,
                  limits: KvLimits | None = None, failures: list[str] | None = None
                  ) -> tuple[WorkerSubscription, WorkerCacheTruth, Source, PrefixIndex]:
    worker = Worker("http://127.0.0.1:1", Role.REGULAR)
    index = PrefixIndex()
    truth = WorkerCacheTruth(worker.url, index, 16)
    source = Source(endpoint, replay=replay)
    hook = None if failures is None else failures.append
    sub = WorkerSubscription(worker, truth, [source], 16, limits or KvLimits(),
                             on_failure=hook)
    return sub, truth, source, index


@contextlib.contextmanager
def _publisher(hwm: int | None = None) -> Iterator[tuple[zmq.asyncio.Context, zmq.asyncio.Socket,
                                                         str]]:
    """A context and a PUB socket bound to a free loopback port (``hwm``: its send high-water
    mark, else ZMQ's), and that endpoint; the socket and the context closed at exit, neither
    lingering."""
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    if hwm is not None:
        pub.setsockopt(zmq.SNDHWM, hwm)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    pub.bind(endpoint)
    try:
        yield ctx, pub, endpoint
    finally:
        pub.close(linger=0)
        ctx.destroy(linger=0)


async def _flooded(peer: subprocess.Popen[bytes], reader: WorkerFeed | WorkerSubscription
                   ) -> float:
    """The longest the event loop was held (``_max_lag_while``) while ``peer`` floods
    ``reader``; the reader is closed and the peer gone when it returns."""
    try:
        return await _max_lag_while(lambda: peer.poll() is None)
    finally:
        await reader.close()
        peer.kill()
        peer.wait()


async def _joined(pub: zmq.asyncio.Socket, source: Source) -> None:
    """Publish seq 0 (a one-block store) until the slow-joining SUB has applied it."""
    payload = _store(1, None, list(range(16)))
    assert await eventually(lambda: source.last_seq == 0,
                             lambda: pub.send_multipart((b"", seq_bytes(0), payload)))


def test_load_feed_flood_keeps_the_event_loop_responsive() -> None:
    async def scenario() -> None:
        port = free_port()
        peer = _peer("flood", port, 2.0, b"load".hex(), encode_load(LoadStat(1, 2, 3, 4)).hex())
        worker = Worker("http://127.0.0.1:1", Role.DECODE)
        feed = WorkerFeed(worker, [f"tcp://127.0.0.1:{port}"], "load", lambda w: None)
        lag = await _flooded(peer, feed)
        assert feed.ranks[0].readings > 0 and worker.loads.running_reqs == 1
        assert lag < LAG_LIMIT_S, f"the event loop was held {lag:.3f} CPU s"

    asyncio.run(scenario())


def test_kv_event_flood_keeps_the_event_loop_responsive() -> None:
    async def scenario() -> None:
        port = free_port()
        payload = encode_batch(0.0, [BlockRemoved(block_hashes=[12345])])
        peer = _peer("flood", port, 2.0, "", payload.hex())
        sub, truth, _, _ = _subscription(f"tcp://127.0.0.1:{port}")
        lag = await _flooded(peer, sub)
        assert truth.batches > 0
        assert lag < LAG_LIMIT_S, f"the event loop was held {lag:.3f} CPU s"

    asyncio.run(scenario())


def test_malformed_framing_neither_resets_nor_floods_the_log(
        caplog: pytest.LogCaptureFixture) -> None:
    """One-frame messages and short sequence frames are counted and dropped: the sequence
    state and the pages stay, a warning is logged once (then rate-limited), and the next
    honest batch applies in order."""
    bad = 3000

    async def scenario() -> None:
        with _publisher(hwm=0) as (_, pub, endpoint):  # nothing dropped: every bad one arrives
            sub, truth, source, index = _subscription(endpoint)
            try:
                await _joined(pub, source)
                for i in range(bad):
                    await (pub.send(b"one frame") if i % 2 else
                           pub.send_multipart((b"", b"\x00\x01", b"\x90")))
                await pub.send_multipart((b"", seq_bytes(1), _store(2, 1, list(range(16, 32)))))
                assert await eventually(lambda: source.last_seq == 1), source.describe()
                assert source.malformed == bad and truth.resets == 0
                assert source.gaps == 0 and source.replays == 0
                assert index.size(sub.worker.url) == 2  # both honest stores are held
            finally:
                await sub.close()

    with caplog.at_level(logging.WARNING, logger="omniinfer.proxy"):
        asyncio.run(scenario())
    lines = [r for r in caplog.records if "malformed" in r.getMessage()]
    assert 1 <= len(lines) <= 2, len(lines)


@pytest.mark.parametrize("offset", [0, 2 * 10**9], ids=["in-range", "out-of-range"])
def test_a_replay_that_never_ends_keeps_its_deadline_memory_and_loop(offset: int) -> None:
    """A gap asks the replay socket, which streams batches forever and never sends the end
    marker: the replay gives up at its byte cap (batches in the range asked for) or at its
    deadline (batches outside it, kept nowhere), never holds the event loop, and the live
    batch that showed the gap is then applied."""
    limits = KvLimits(replay_timeout_s=0.5, replay_max_bytes=4 << 20)

    async def scenario() -> None:
        with _publisher() as (_, pub, endpoint):
            replay_port = free_port()
            peer = _peer("replay", replay_port, 6.0, 100_000, offset)
            sub, truth, source, _ = _subscription(endpoint, f"tcp://127.0.0.1:{replay_port}",
                                                  limits)
            try:
                await _joined(pub, source)
                await asyncio.sleep(0.5)  # the replay peer is up
                tracemalloc.start()
                started = time.monotonic()
                await pub.send_multipart((b"", seq_bytes(10**9),
                                          _store(3, 1, list(range(16, 32)))))
                lag = await _max_lag_while(lambda: source.last_seq != 10**9, limit_s=8.0)
                took = time.monotonic() - started
                _, peak = tracemalloc.get_traced_memory()
                tracemalloc.stop()
                assert source.last_seq == 10**9, source.describe()
                assert source.gaps == 1 and source.replays == 0 and source.replay_failures == 1
                assert took < limits.replay_timeout_s + 2.0, f"the replay took {took:.2f} s"
                assert peak < 24 << 20, f"{peak / 2**20:.0f} MiB held during the replay"
                assert lag < LAG_LIMIT_S, f"the event loop was held {lag:.3f} CPU s"
            finally:
                if tracemalloc.is_tracing():
                    tracemalloc.stop()
                await sub.close()
                peer.kill()
                peer.wait()

    asyncio.run(scenario())


def test_every_socket_to_a_worker_bounds_its_queue_and_message_size(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every connection to a worker (KV SUB, replay DEALER, load-feed SUB) is the router's own
    ZMTP client (``test_proxy_zmtp.py``), with bounded messages, frames and queue."""
    from omniinfer.proxy import zmtp

    seen: list[tuple[str, zmtp.ZmtpLimits]] = []
    dial = zmtp.connect

    async def recorded(endpoint: str, socket_type: str, limits: zmtp.ZmtpLimits | None = None,
                       **kwargs: Any) -> zmtp.ZmtpConnection:
        seen.append((socket_type, limits or zmtp.ZmtpLimits()))
        return await dial(endpoint, socket_type, limits, **kwargs)

    monkeypatch.setattr(zmtp, "connect", recorded)

    async def scenario() -> None:
        with _publisher() as (ctx, pub, endpoint):
            replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
            replay = ctx.socket(zmq.ROUTER)
            replay.bind(replay_endpoint)
            sub, _, source, _ = _subscription(endpoint, replay_endpoint)
            feed = WorkerFeed(Worker("http://127.0.0.1:2", Role.DECODE), [endpoint], "load",
                              lambda w: None)
            try:
                await _joined(pub, source)
                await pub.send_multipart((b"", seq_bytes(5), _store(4, 1, list(range(16, 32)))))
                assert await eventually(lambda: source.last_seq == 5)  # after a (failed) replay
            finally:
                await sub.close()
                await feed.close()
        kinds = [kind for kind, _ in seen]
        assert kinds.count(zmtp.SUB) >= 2 and zmtp.DEALER in kinds, seen  # KV, feed, replay
        for kind, limits in seen:
            assert 0 < limits.queue_messages <= 1024, (kind, limits)
            assert 0 < limits.max_message_bytes <= 64 << 20, (kind, limits)
            assert 0 < limits.max_frames <= 64, (kind, limits)

    asyncio.run(scenario())


def test_an_oversized_message_never_reaches_the_router() -> None:
    """ZMQ drops a message over ``max_message_bytes`` (and the connection); the subscriber
    forgets, reconnects and applies the honest batches after it."""
    limits = KvLimits(max_message_bytes=1 << 20)

    async def scenario() -> None:
        with _publisher() as (_, pub, endpoint):
            sub, truth, source, index = _subscription(endpoint, None, limits)
            try:
                await _joined(pub, source)
                huge = _store(5, 1, list(range(16, 16 + (1 << 19))))  # > 1 MiB of msgpack
                assert len(huge) > limits.max_message_bytes
                await pub.send_multipart((b"", seq_bytes(1), huge))
                honest = _store(6, None, list(range(100, 116)))
                seqs = iter(range(2, 10_000))
                assert await eventually(
                    lambda: index.size(sub.worker.url) == 1 and truth.blocks() == 1,
                    lambda: pub.send_multipart((b"", seq_bytes(next(seqs)), honest)))
                assert source.last_seq is not None and source.last_seq >= 2
                assert truth.describe()["stored_pages"] <= 3  # page 5 never stored
            finally:
                await sub.close()

    asyncio.run(scenario())


def test_large_pages_that_are_never_evicted_stay_within_the_token_budget() -> None:
    """A publisher that stores 4,096-token pages and never evicts: the worker's view keeps at
    most its token budget (the oldest forgotten first) and still follows honest stores."""
    budget = 16 * (4096 + RUN_CHARGE)

    async def scenario() -> None:
        with _publisher(hwm=0) as (_, pub, endpoint):
            worker = Worker("http://127.0.0.1:1", Role.REGULAR)
            index = PrefixIndex()
            truth = WorkerCacheTruth(worker.url, index, 16, max_tokens=budget)
            source = Source(endpoint)
            sub = WorkerSubscription(worker, truth, [source], 4096)
            try:
                await _joined(pub, source)
                most = 0
                for seq in range(1, 201):
                    tokens = list(range(seq * 5000, seq * 5000 + 4096))
                    await pub.send_multipart((b"", seq_bytes(seq),
                                              _store(1000 + seq, None, tokens)))
                    most = max(most, truth.tokens())
                    if seq % 20 == 0:
                        await asyncio.sleep(0.01)
                assert await eventually(lambda: source.last_seq == 200), source.describe()
                assert max(most, truth.tokens()) <= budget and truth.tokens() == budget
                assert index.size(worker.url) == 16 * 256 and source.gaps == 0
                assert truth.describe()["evicted_pages"] == 200 + 1 - 16
            finally:
                await sub.close()

    asyncio.run(scenario())


def test_a_deeply_nested_payload_is_one_bad_message() -> None:
    async def scenario() -> None:
        with _publisher() as (_, pub, endpoint):
            failures: list[str] = []
            sub, truth, source, _ = _subscription(endpoint, failures=failures)
            try:
                await _joined(pub, source)
                nested = b"\x92\xcb" + b"\x00" * 8 + b"\x91" * 200_000 + b"\x90"
                await pub.send_multipart((b"", seq_bytes(1), nested))
                await pub.send_multipart((b"", seq_bytes(2),
                                          _store(7, None, list(range(40, 56)))))
                assert await eventually(lambda: source.last_seq == 2), source.describe()
                assert source.malformed == 1 and source.failures == 0 and not failures
                assert truth.blocks() == 1  # the undecodable batch forgot page 1; page 7 held
            finally:
                await sub.close()

    asyncio.run(scenario())


def test_a_failing_reader_is_logged_counted_and_restarted(
        caplog: pytest.LogCaptureFixture) -> None:
    """A reader whose socket cannot even connect neither dies nor fails silently: each failure
    is logged with its traceback, counted, reported to the hook, and retried."""

    async def scenario() -> None:
        failures: list[str] = []
        sub, _, source, _ = _subscription("tcp://not a host:1", failures=failures,
                                          limits=KvLimits(restart_backoff_s=0.05))
        feed = WorkerFeed(Worker("http://127.0.0.1:3", Role.DECODE), ["tcp://not a host:2"],
                          "load", lambda w: None, on_failure=failures.append,
                          restart_backoff_s=0.05)
        try:
            assert await eventually(lambda: source.failures >= 2
                                     and feed.ranks[0].failures >= 2, timeout=5.0)
            assert not any(t.done() for t in sub._tasks + feed._tasks)
            assert {"kv-events", "load-feed"} <= set(failures)
        finally:
            await sub.close()
            await feed.close()

    with caplog.at_level(logging.WARNING, logger="omniinfer.proxy"):
        asyncio.run(scenario())
    failed = [r for r in caplog.records if "failed" in r.getMessage()]
    assert failed and all(r.exc_info for r in failed)


def test_a_silent_load_feed_gets_a_fresh_socket_and_hears_a_late_publisher(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """ZMQ does not redial after a protocol error (an oversized reading), so a rank silent for
    ``RESUBSCRIBE_AFTER_S`` gets a fresh socket: no failure, and a publisher that (re)starts
    later is heard."""
    from omniinfer.proxy import load_subscriber as router_feed

    monkeypatch.setattr(router_feed, "RESUBSCRIBE_AFTER_S", 0.2)

    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        port = free_port()
        worker = Worker("http://127.0.0.1:1", Role.DECODE)
        feed = WorkerFeed(worker, [f"tcp://127.0.0.1:{port}"], "load", lambda w: None)
        pub = ctx.socket(zmq.PUB)
        try:
            await asyncio.sleep(0.7)  # a few fresh sockets, nobody publishing
            pub.bind(f"tcp://127.0.0.1:{port}")
            huge = b"\x00" * (router_feed.MAX_MESSAGE_BYTES + 1)
            await pub.send_multipart((b"load", seq_bytes(0), huge))  # drops the connection
            reading = encode_load(LoadStat(4, 0, 1, 10))
            seqs = iter(range(1, 10_000))
            assert await eventually(
                lambda: worker.loads.running_reqs == 4,
                lambda: pub.send_multipart((b"load", seq_bytes(next(seqs)), reading)))
            rank = feed.ranks[0]
            assert rank.failures == 0 and rank.malformed == 0
        finally:
            await feed.close()
            pub.close(linger=0)
            ctx.destroy(linger=0)

    asyncio.run(scenario())


def test_the_router_hands_its_kv_and_feed_bounds_and_failure_metric_to_the_readers() -> None:
    from omniinfer.proxy.config import RouterConfig
    from omniinfer.proxy.core import Router

    router = Router(RouterConfig(worker_urls=["http://127.0.0.1:9"], cache_truth="kv-events",
                                 kv_events_max_tokens=12345,
                                 kv_events_max_message_bytes=1 << 16))
    assert router.cache_truth.max_tokens == 12345
    assert router.cache_truth.limits.max_message_bytes == 1 << 16
    router.cache_truth.on_failure("kv-events")
    router.load_feeds.on_failure("load-feed")
    text = router.metrics.render().decode()
    for task in ("kv-events", "load-feed"):
        assert f'omniproxy_background_task_failures_total{{task="{task}"}} 1' in text, task
    default = Router(RouterConfig(worker_urls=["http://127.0.0.1:9"]))
    assert default.cache_truth.max_tokens == RouterConfig().kv_events_max_tokens
