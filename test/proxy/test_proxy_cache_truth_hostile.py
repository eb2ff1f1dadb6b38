"""What one hostile worker's messages may cost the router, without sockets: time linear in a
message, memory bounded by tokens (not pages), pages bounded in length, decoding bounded in
depth, load figures bounded in value, warnings bounded in number."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import msgspec
import pytest

from omniinfer.kv_event_wire import Batch, ProtocolError, Removed, Stored, decode_batch
from omniinfer.load_feed_wire import LoadStat, decode_load, encode_load
from omniinfer.proxy import worker_cache_truth
from omniinfer.proxy.control import WarningLimiter
from omniinfer.proxy.prefix import ROOT_HASH, PrefixIndex, block_hashes, chain_hash
from omniinfer.proxy.worker_cache_truth import RUN_CHARGE, PageChain, WorkerCacheTruth
from omniinfer.proxy.workers import MAX_LOAD_COUNT, MAX_LOAD_RATE, Role, Worker

KEY = "http://w:1"


def _fastest(run: Callable[[], object], repeats: int = 3) -> float:
    """The least time of ``repeats`` calls (scheduler noise only ever adds time)."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


def _store_one_page(tokens: tuple[int, ...]) -> None:
    chain = PageChain(16, max_page_tokens=1 << 20)
    held = chain.store(Stored((99,), None, tokens, len(tokens)))
    assert held == block_hashes(tokens, 16)
    assert chain.remove(Removed((99,))) == held


def test_one_huge_page_applies_in_linear_time() -> None:
    """A page 16x longer costs about 16x, not 256x: the blocks ending in it are gathered once,
    not by growing a tuple per block (quadratic: tens of seconds at 2**20 tokens). A ratio of
    two sizes measured back to back, so the machine's speed and load cancel."""
    small, large = tuple(range(1 << 16)), tuple(range(1 << 20))
    ratio = _fastest(lambda: _store_one_page(large)) / _fastest(lambda: _store_one_page(small))
    assert ratio < 64, f"16x the tokens cost {ratio:.0f}x the time"


def _children_of_last_page(pages: int, children: int = 5_000) -> Callable[[], None]:
    def run() -> None:
        chain = PageChain(16)
        chain.store(Stored(tuple(range(1, pages + 1)), None, tuple(range(pages)), 1))
        for i in range(children):
            chain.store(Stored((pages + 1 + i,), pages, (i,), 1))
        assert chain.stats.stored_pages == pages + children
    return run


def test_children_of_a_page_late_in_a_long_run_cost_no_scan_each() -> None:
    """Child events naming the last page of a run of 200,000 one-token pages cost about what
    they cost for a run of 200: each finds the parent's place without scanning the run (a
    scan made the long case ~100x slower). Measured as a ratio, back to back."""
    short = _fastest(_children_of_last_page(200))
    long = _fastest(_children_of_last_page(200_000))
    assert long < 5 * short + 0.05, f"{long:.3f} s against {short:.3f} s"


def test_pages_longer_than_the_cap_are_refused_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """An oversized page is refused before a single router block of it is hashed."""
    hashed: list[int] = []

    def counted(previous: int, tokens: Sequence[int]) -> int:
        hashed.append(len(tokens))
        return chain_hash(previous, tokens)

    monkeypatch.setattr(worker_cache_truth, "chain_hash", counted)
    chain = PageChain(16, max_page_tokens=4096)
    assert chain.store(Stored((1,), None, tuple(range(1 << 20)), 1 << 20)) == []
    assert hashed == []
    assert chain.stats.oversized_events == 1 and len(chain) == 0 and chain.tokens == 0
    ok = chain.store(Stored((2,), None, tuple(range(4096)), 4096))
    assert len(ok) == 256 and chain.tokens == 4096 + RUN_CHARGE
    assert len(hashed) == 256


def test_the_token_budget_evicts_the_oldest_pages() -> None:
    """4,096-token pages that are never evicted by the worker: the router holds at most its
    token budget (oldest stores forgotten first), not ``max_pages`` pages of any length."""
    index = PrefixIndex()
    budget = 10 * (4096 + RUN_CHARGE)
    truth = WorkerCacheTruth(KEY, index, 16, sources=2, max_tokens=budget)
    paths = []
    for i in range(40):
        tokens = tuple(range(i * 10_000, i * 10_000 + 4096))
        paths.append(tokens)
        truth.apply(i % 2, Batch(0.0, (Stored((i + 1,), None, tokens, 4096),), 0, 0))
        assert truth.tokens() <= budget
    assert truth.tokens() == budget and truth.describe()["evicted_pages"] == 30
    newest, oldest = block_hashes(paths[-1], 16), block_hashes(paths[0], 16)
    assert index.match(newest)[KEY] == 256
    assert KEY not in index.match(oldest)
    assert truth.blocks() == 10 * 256


def test_removals_and_clears_give_their_tokens_back() -> None:
    chain = PageChain(4)
    chain.store(Stored((1, 2, 3), None, tuple(range(12)), 4))
    assert chain.tokens == 12 + RUN_CHARGE
    chain.remove(Removed((1, 2)))
    assert chain.tokens == 12 + RUN_CHARGE  # page 3 still needs the run it was stored in
    chain.remove(Removed((3,)))
    assert chain.tokens == 0
    chain.store(Stored((4,), None, (1, 2, 3, 4), 4))
    chain.clear()
    assert chain.tokens == 0 and len(chain) == 0


def test_a_single_store_over_the_budget_is_not_kept() -> None:
    index = PrefixIndex()
    truth = WorkerCacheTruth(KEY, index, 16, max_tokens=1000)
    truth.apply(0, Batch(0.0, (Stored((1,), None, tuple(range(2048)), 2048),), 0, 0))
    assert truth.tokens() == 0 and truth.blocks() == 0 and index.size(KEY) == 0
    truth.apply(0, Batch(0.0, (Stored((2,), None, tuple(range(32)), 32),), 0, 0))
    assert truth.blocks() == 2 and index.match([chain_hash(ROOT_HASH, tuple(range(16)))])


@pytest.mark.parametrize("payload", [
    b"\x91" * 200_000 + b"\x90",
    b"\x92\xcb" + b"\x00" * 8 + b"\x91" * 200_000 + b"\x90",
    b"\x93\xcb" + b"\x00" * 8 + b"\x91\x81\xa4type" + b"\x91" * 200_000 + b"\x90" + b"\xc0",
])
def test_deeply_nested_msgpack_is_a_protocol_error(payload: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_batch(payload)


def test_a_deeply_nested_load_reading_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError):
        decode_load(b"\x92\xa8LoadStat" + b"\x91" * 200_000 + b"\x90")
    with pytest.raises(ProtocolError):
        decode_load(b"\x91" * 200_000 + b"\x90")


def test_load_figures_from_the_feed_are_bounded() -> None:
    """The largest msgpack integers (2**64 - 1), summed over ranks, stay within the bounds
    ``WorkerLoads.from_json`` keeps for a poll; usage stays a finite fraction-like figure."""
    import asyncio

    import zmq.asyncio

    from omniinfer.proxy.load_subscriber import WorkerFeed

    big = (1 << 64) - 1
    payload = msgspec.msgpack.encode(["LoadStat", big, big, big, 1, 0, big, big, big, big, big])
    assert decode_load(payload).num_tokens == big  # a valid uint64 on the wire

    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        worker = Worker("http://127.0.0.1:1", Role.DECODE)
        feed = WorkerFeed(worker, ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"], "load",
                          lambda w: None)
        for rank in feed.ranks:
            feed._apply(rank, [b"load", (1).to_bytes(8, "big"), payload])
        loads = worker.loads
        for name in ("running_reqs", "waiting_reqs", "waiting_uncached_tokens", "used_tokens",
                     "max_total_tokens", "max_running_reqs", "prefill_busy_us",
                     "prefill_uncached_tokens"):
            assert 0 <= getattr(loads, name) <= MAX_LOAD_COUNT, name
        assert 0.0 <= loads.token_usage <= MAX_LOAD_RATE
        feed._apply(feed.ranks[0], [b"load", (2).to_bytes(8, "big"),
                                    encode_load(LoadStat(1, 0, 9, 99))])
        feed._apply(feed.ranks[1], [b"load", (2).to_bytes(8, "big"),
                                    encode_load(LoadStat(2, 0, 1, 99))])
        assert (worker.loads.running_reqs, worker.loads.used_tokens) == (3, 10)
        await feed.close()
        ctx.destroy(linger=0)

    asyncio.run(scenario())


def test_warnings_are_limited_per_source(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    limiter = WarningLimiter(every_s=10.0, clock=lambda: now[0])
    log = logging.getLogger("omniinfer.proxy")
    with caplog.at_level(logging.WARNING, logger="omniinfer.proxy"):
        for _ in range(1000):
            limiter.warn(log, "a", "bad message from %s", "a")
            limiter.warn(log, "b", "bad message from %s", "b")
        now[0] = 10.5
        limiter.warn(log, "a", "bad message from %s", "a")
    lines = [r.getMessage() for r in caplog.records]
    assert lines[:2] == ["bad message from a", "bad message from b"]
    assert len(lines) == 3 and "999 similar" in lines[2]


def test_the_new_flags_reach_the_config() -> None:
    import argparse

    from omniinfer.proxy import cli as router_cli
    from omniinfer.proxy.config import RouterConfig, config_from_args

    parser = argparse.ArgumentParser()
    router_cli.add_arguments(parser)
    args = parser.parse_args(["--worker-urls", "http://w:1", "--kv-events-max-tokens", "5000",
                              "--kv-events-max-message-bytes", "65536"])
    config = config_from_args(args)
    assert (config.kv_events_max_tokens, config.kv_events_max_message_bytes) == (5000, 65536)
    default = RouterConfig()
    assert default.kv_events_max_tokens == 1 << 20 and default.kv_events_max_message_bytes == 4 << 20
    with pytest.raises(ValueError, match="kv-events-max-message-bytes"):
        RouterConfig(kv_events_max_message_bytes=0).validate()
    with pytest.raises(ValueError, match="kv-events-max-tokens"):
        RouterConfig(kv_events_max_tokens=0).validate()


def test_many_one_token_stores_are_charged_for_their_runs() -> None:
    """A store is a run with records of its own: 1-token root stores (SGLang on CPU pages by one
    token) must not hold the worker's budget in tokens while costing ~460 B each."""
    index = PrefixIndex()
    budget = 3000
    truth = WorkerCacheTruth(KEY, index, 16, max_tokens=budget)
    for i in range(10_000):
        truth.apply(0, Batch(0.0, (Stored((i + 1,), None, (i,), 1),), 0, 0))
    held = len(truth.chains[0])
    assert truth.tokens() <= budget
    assert held == budget // (1 + RUN_CHARGE), held  # before: 3,000 runs of one token
