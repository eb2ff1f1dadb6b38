"""What one KV-event publisher's batches may cost the event loop once they are in: a large
batch is applied in slices with yields between them, a replay yields by bytes as the live reader
does, and a replay's bytes buy a pause before the next one. Each failed on the reader before."""

from __future__ import annotations

import asyncio
import gc
import time
from typing import Any

import pytest
import zmq.asyncio

from omniinfer.kv_event_wire import BlockStored, encode_batch
from omniinfer.proxy import cache_truth
from omniinfer.proxy.cache_truth import KvLimits, Source, WorkerSubscription
from omniinfer.proxy.prefix import PrefixIndex
from omniinfer.proxy.worker_cache_truth import WorkerCacheTruth
from omniinfer.proxy.workers import Role, Worker

HOLD_LIMIT_S = 0.5
SLICES_AT_LEAST = 4


def _tiny_stores(count: int, first: int = 1) -> bytes:
    """One batch of ``count`` one-token root stores (SGLang on CPU pages by one token)."""
    return encode_batch(0.0, [BlockStored(block_hashes=[first + i], parent_block_hash=None,
                                          token_ids=[i % 50_000], block_size=1, lora_id=None)
                              for i in range(count)])


def _assert_sliced(worst: float, total: float) -> None:
    """The work was cut into at least ``SLICES_AT_LEAST`` slices and no slice is absurd. A
    relative bound, because a slice's CPU time scales with the machine (0.06 s here, 0.106 s on
    a slower one); a reader that never yields holds the loop for the whole ``total``."""
    assert worst < total / SLICES_AT_LEAST, f"held {worst:.3f} of {total:.3f} CPU s at once"
    assert worst < HOLD_LIMIT_S, f"the event loop was held {worst:.3f} CPU s"


async def _worst_hold(work: Any) -> tuple[float, float]:
    """The longest a 5 ms ticker was held, and the CPU the whole ``work`` took (CPU s of this
    thread). What earlier tests left on the heap is frozen first: a full collection scanning it
    is theirs, not the reader's."""
    gc.collect()
    gc.freeze()
    started = time.thread_time()
    task = asyncio.ensure_future(work)
    worst = 0.0
    while not task.done():
        before = time.thread_time()
        await asyncio.sleep(0.005)
        worst = max(worst, time.thread_time() - before)
    await task
    gc.unfreeze()
    return worst, time.thread_time() - started


def _subscription(ctx: zmq.asyncio.Context, limits: KvLimits | None = None
                  ) -> tuple[WorkerSubscription, WorkerCacheTruth, Source]:
    worker = Worker("http://127.0.0.1:1", Role.REGULAR)
    truth = WorkerCacheTruth(worker.url, PrefixIndex(), 16, max_tokens=1 << 24)
    source = Source("tcp://127.0.0.1:9", replay="tcp://127.0.0.1:9")
    return WorkerSubscription(worker, truth, [source], 1, limits or KvLimits()), truth, source


def test_a_large_batch_is_applied_in_slices() -> None:
    payload = _tiny_stores(45_000)
    assert len(payload) < KvLimits().max_message_bytes

    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        sub, truth, source = _subscription(ctx)
        try:
            worst, total = await _worst_hold(sub._apply(0, source, 1, payload))
            assert len(truth.chains[0]) == 45_000 and truth.batches == 1
            assert source.last_seq == 1
            _assert_sliced(worst, total)
        finally:
            await sub.close()
            ctx.destroy(linger=0)

    asyncio.run(scenario())


@pytest.fixture
def replayed(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """``fetch_replay`` answered from memory: 48 batches of 400 tiny stores for any range."""
    asked: list[tuple[int, int]] = []

    async def fake_fetch(endpoint: str, start: int, stop: int,
                         limits: KvLimits) -> dict[int, bytes]:
        asked.append((start, stop))
        return {seq: _tiny_stores(400, first=1 + seq * 1000) for seq in range(start, stop)}

    monkeypatch.setattr(cache_truth, "fetch_replay", fake_fetch)
    return asked


def test_a_replay_yields_by_bytes_and_pays_for_them_before_the_next(
        replayed: list[tuple[int, int]]) -> None:
    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        limits = KvLimits(drain_batches=64, drain_bytes=64 << 10, replay_bytes_per_s=1 << 20)
        sub, truth, source = _subscription(ctx, limits)
        try:
            worst, total = await _worst_hold(sub._replay(0, source, 10, 58))
            assert source.replays == 1 and len(truth.chains[0]) == 48 * 400
            _assert_sliced(worst, total)
            # the next gap, at once: not replayed while the first one's bytes are paid for
            assert await sub._replay(0, source, 60, 70) is False
            assert replayed == [(10, 58)]
        finally:
            await sub.close()
            ctx.destroy(linger=0)

    asyncio.run(scenario())


def test_what_a_worker_advertises_is_shortened_in_reasons() -> None:
    """A 1 MiB ``dp_size`` or endpoint host in ``/server_info`` must not become a 1 MiB log
    line and ``/list_workers`` reason."""
    from omniinfer.proxy.kv_sources import NoEvents, dial_rank, sources_from_server_info
    from omniinfer.proxy.load_subscriber import NoFeed, feed_endpoints

    huge = "x" * (1 << 20)
    reasons = []
    for call in (lambda: feed_endpoints({"kv_events": {"load_endpoint_port_base": 1,
                                                       "dp_size": huge}}, "127.0.0.1"),
                 lambda: sources_from_server_info({"kv_events": {"endpoint": "tcp://h:1",
                                                                 "dp_size": huge}}, "127.0.0.1"),
                 lambda: dial_rank(f"tcp://{huge}:5557", 0, "127.0.0.1")):
        with pytest.raises((NoEvents, NoFeed)) as caught:
            call()
        reasons.append(str(caught.value))
    assert all(len(r) < 300 for r in reasons), [len(r) for r in reasons]
