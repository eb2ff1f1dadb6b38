"""``--cache-truth kv-events`` end to end: OmniProxy subscribed to real ``omniinfer
emulate-worker`` processes that publish SGLang's KV events, beside the router's own index."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
from proxy_helpers import get, post, sse_events, wait_until

from omni_testing import eventually
from omniinfer.child_process import free_port
from omniinfer.emulator.process import EmulatorProcess
from omniinfer.kv_event_wire import BlockStored, Stored, encode_batch, seq_bytes
from omniinfer.proxy.cache_truth import Source, WorkerSubscription
from omniinfer.proxy.prefix import PrefixIndex, block_hashes
from omniinfer.proxy.process import RouterProcess
from omniinfer.proxy.worker_cache_truth import WorkerCacheTruth
from omniinfer.proxy.workers import Role, Worker

BLOCK = 16


def _emu(log: Path, kv_port: int | None, replay_port: int | None = None,
         port: int | None = None) -> EmulatorProcess:
    """One emulated worker (token ids in, 2 output tokens out, a 300-token pool), publishing
    its KV events on ``kv_port`` when one is given."""
    args = ["--max-total-tokens", "300"]
    if kv_port is not None:
        config = {"publisher": "zmq", "endpoint": f"tcp://*:{kv_port}"}
        if replay_port is not None:
            config["replay_endpoint"] = f"tcp://*:{replay_port}"
        args += ["--kv-events-config", json.dumps(config)]
    return EmulatorProcess(profile="cpu-smollm2", time_scale=0.01, port=port, extra_args=args,
                           log_path=log).start()


def _router(tmp: Path, started: list[Any], *args: str) -> RouterProcess:
    proc = RouterProcess(["--apc-block-size", str(BLOCK), "--health-check-interval-secs", "60",
                          *args], tmp / f"router-{len(started)}.log")
    proc.start()
    started.append(proc)
    return proc


def _generate(router: RouterProcess, ids: list[int], stream: bool = False) -> int:
    """Send ``ids``; the worker's reported cached tokens."""
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}, "stream": stream}
    status, answer, _ = post(router.base_url + "/generate", body)
    assert status == 200, answer
    final = sse_events(answer)[-2] if stream else answer
    return int(final["meta_info"]["cached_tokens"])


def _truth(router: RouterProcess, url: str) -> dict[str, Any]:
    return get(router.base_url + "/list_workers")[1]["cache_truth"]["workers"][url]


def _connected(router: RouterProcess, url: str) -> None:
    """Wait until the router's subscriber completed its handshake with the publisher."""
    assert wait_until(lambda: _truth(router, url)["sources"][0]["connected"], timeout=10)


def _blocks_settle(router: RouterProcess, url: str, blocks: int) -> None:
    """Wait until the worker's events put exactly ``blocks`` router blocks in its index."""
    assert wait_until(lambda: _truth(router, url).get("router_blocks") == blocks, timeout=10), \
        _truth(router, url)


def _predicted(prompt: int, held_blocks: int) -> int:
    return min(prompt - 1, held_blocks * BLOCK)


def test_kv_events_follow_eviction_that_the_router_index_misses(
        tmp_logs: tuple[Path, list[Any]]) -> None:
    tmp, started = tmp_logs
    e1 = _emu(tmp / "e1.log", free_port())
    started.append(e1)
    e2 = _emu(tmp / "e2.log", None)
    started.append(e2)
    events = _router(tmp, started, "--worker-urls", e1.url, "--cache-truth", "kv-events")
    own = _router(tmp, started, "--worker-urls", e2.url)
    assert _truth(events, e1.url)["cache_truth"] == "kv-events"
    _connected(events, e1.url)
    p = list(range(100, 200))
    flood = list(range(1000, 1250))  # 250 more tokens in a 300-token pool: p is evicted
    for router, url in ((events, e1.url), (own, e2.url)):
        assert _generate(router, p) == 0
        if router is events:  # the index fills only when the worker reports the store
            _blocks_settle(router, url, (len(p) + 1) // BLOCK)
        assert _generate(router, p, stream=True) == len(p) - 1
        assert _generate(router, flood) == 0
        if router is events:  # exactly the flood's blocks: p's were removed
            _blocks_settle(router, url, (len(flood) + 1) // BLOCK)
        status, answer, _ = post(router.base_url + "/v1/completions", {
            "prompt": flood, "max_tokens": 2, "temperature": 0})
        assert status == 200 and answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 249
        assert _generate(router, p) == 0  # the worker evicted p
    stale = _predicted(len(p), (len(p) + 1) // BLOCK)
    expected = {
        "kv-events": (events, {"exact": 5, "over": 0, "under": 0,
                               "abs_error_tokens": (len(p) - 1 - stale) + (249 - 240)}),
        "router": (own, {"exact": 4, "over": 1, "under": 0,
                         "abs_error_tokens": (len(p) - 1 - stale) + stale + (249 - 240)}),
    }
    for label, (router, counts) in expected.items():
        tally = get(router.base_url + "/list_workers")[1]["cache_prediction"][label]
        assert {k: tally[k] for k in counts} == counts, tally
        metrics = get(router.base_url + "/metrics")[1]
        for outcome in ("exact", "over"):
            line = f'omniproxy_cache_prediction_total{{cache_truth="{label}",outcome="{outcome}"}}'
            value = counts[outcome]
            assert (f"{line} {float(value)}" in metrics) if value else line not in metrics
        assert (f'omniproxy_cache_prediction_error_tokens_total{{cache_truth="{label}"}} '
                f'{float(counts["abs_error_tokens"])}') in metrics


def test_late_join_replays_and_restart_forgets(tmp_logs: tuple[Path, list[Any]]) -> None:
    tmp, started = tmp_logs
    kv, replay = free_port(), free_port()
    worker = _emu(tmp / "w.log", kv, replay)
    started.append(worker)
    q = list(range(2000, 2100))
    assert post(worker.url + "/generate", {"input_ids": q, "sampling_params": {
        "max_new_tokens": 2}})[0] == 200  # published before the router exists
    router = _router(tmp, started, "--worker-urls", worker.url, "--cache-truth", "kv-events")

    def poke_until(done: Any, base: int) -> dict[str, Any]:
        pokes = iter(range(base, base + 10_000))

        def poked() -> bool:  # direct requests make the worker publish; the router listens
            post(worker.url + "/generate", {"input_ids": [next(pokes)] * 20,
                                            "sampling_params": {"max_new_tokens": 2}})
            return bool(done(_truth(router, worker.url)["sources"][0]))

        assert wait_until(poked, timeout=30, step=0.1), _truth(router, worker.url)
        return _truth(router, worker.url)

    joined = poke_until(lambda s: s["replays"], 3000)  # first live batch is not 0: replay 0..
    assert joined["sources"][0]["replays"] == 1 and joined["sources"][0]["gaps"] == 0
    assert joined["sources"][0]["connected"]
    assert _generate(router, q) == len(q) - 1  # predicted from the replayed store: exact

    worker.stop()  # a restart: same ports, an empty cache, sequence numbers from 0 again
    assert wait_until(lambda: _truth(router, worker.url)["sources"][0]["disconnects"] == 1)
    assert _truth(router, worker.url)["router_blocks"] == 0  # forgotten while it is away
    worker = _emu(tmp / "w2.log", kv, replay, port=worker.port)
    started.append(worker)
    back = poke_until(lambda s: s["last_seq"] is not None, 4000)
    assert back["sources"][0]["connected"] and back["router_blocks"] >= 1
    assert _generate(router, q) == 0
    tally = get(router.base_url + "/list_workers")[1]["cache_prediction"]["kv-events"]
    assert (tally["exact"], tally["over"], tally["under"]) == (2, 0, 0), tally


def test_fallback_and_explicit_endpoint(tmp_logs: tuple[Path, list[Any]]) -> None:
    tmp, started = tmp_logs
    plain = _emu(tmp / "plain.log", None)
    started.append(plain)
    kv = free_port()
    publishing = _emu(tmp / "pub.log", kv)
    started.append(publishing)
    endpoint = f"tcp://127.0.0.1:{kv}"
    router = _router(tmp, started, "--worker-urls", plain.url, publishing.url,
                     "--cache-truth", "kv-events", "--policy", "round_robin",
                     "--kv-events-endpoint", f"{publishing.url}={endpoint}",
                     "--kv-events-endpoint", "http://elsewhere:1=tcp://127.0.0.1:9")
    _connected(router, publishing.url)
    followed = _truth(router, publishing.url)
    assert followed["cache_truth"] == "kv-events" and followed["worker_page_size"] is None
    assert [s["endpoint"] for s in followed["sources"]] == [endpoint]
    assert "http://elsewhere:1" in Path(router.log_path).read_text()  # named, matches no worker
    fallback = _truth(router, plain.url)
    assert fallback["cache_truth"] == "router" and "--kv-events-config" in fallback["reason"]
    assert "using the router's own index" in Path(router.log_path).read_text()
    ids = list(range(5000, 5040))
    assert [_generate(router, ids) for _ in range(2)] == [0, 0]  # round robin: one each
    _blocks_settle(router, publishing.url, (len(ids) + 1) // BLOCK)
    assert [_generate(router, ids) for _ in range(2)] == [len(ids) - 1] * 2
    tally = get(router.base_url + "/list_workers")[1]["cache_prediction"]
    assert tally["router"]["exact"] == tally["kv-events"]["exact"] == 2, tally
    assert tally["router"]["measured"] == tally["kv-events"]["measured"] == 2


def test_gap_without_replay_forgets_and_gap_with_replay_is_filled() -> None:
    """A real SUB socket against a test publisher that skips a sequence number (the drop a
    real publisher makes past its high-water mark), then a fake replay server that has it."""
    asyncio.run(_gap_scenario())


async def _gap_scenario() -> None:
    ctx = zmq.asyncio.Context()
    pub, fake_replay = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    port, replay_port = free_port(), free_port()
    pub.bind(f"tcp://127.0.0.1:{port}")
    fake_replay.bind(f"tcp://127.0.0.1:{replay_port}")
    worker = Worker("http://127.0.0.1:1", Role.REGULAR)
    a, b = Stored((1,), None, tuple(range(16)), 16), Stored((2,), 1, tuple(range(16, 32)), 16)
    c = Stored((3,), 2, tuple(range(32, 48)), 16)
    batches = {0: encode_batch(0.0, [_wire(a)]), 1: encode_batch(0.0, [_wire(b)]),
               2: encode_batch(0.0, [_wire(c)])}
    for replay, expect_blocks in ((None, 0), (f"tcp://127.0.0.1:{replay_port}", 3)):
        index = PrefixIndex()
        truth = WorkerCacheTruth(worker.url, index, 16)
        source = Source(f"tcp://127.0.0.1:{port}", replay=replay)
        sub = WorkerSubscription(worker, truth, [source], 16)
        # a SUB socket misses what is published before it connects: send until it has it
        assert await eventually(lambda s=source: s.last_seq == 0,
                                 lambda: pub.send_multipart((b"", seq_bytes(0), batches[0])))
        assert index.size(worker.url) == 1
        server = asyncio.ensure_future(_fake_replay_serve(fake_replay, batches))
        await pub.send_multipart((b"", seq_bytes(2), batches[2]))  # 1 is lost
        assert await eventually(lambda s=source: s.last_seq == 2)
        server.cancel()
        await sub.close()
        assert index.size(worker.url) == expect_blocks
        if replay is None:
            assert (source.gaps, truth.describe()["orphan_pages"]) == (1, 1)
        else:
            assert (source.gaps, source.replays) == (0, 1)
            assert index.match(block_hashes(list(range(48)), 16))[worker.url] == 3
    pub.close(0)
    fake_replay.close(0)
    ctx.destroy(0)


def _wire(event: Stored) -> BlockStored:
    return BlockStored(block_hashes=list(event.hashes), parent_block_hash=event.parent,
                       token_ids=list(event.tokens), block_size=event.block_size, lora_id=None)


async def _fake_replay_serve(sock: zmq.asyncio.Socket, batches: dict[int, bytes]) -> None:
    while True:
        client, _, start = await sock.recv_multipart()
        first = int.from_bytes(start, "big", signed=True)
        for seq in sorted(s for s in batches if s >= first):
            await sock.send_multipart((client, b"", b"", seq_bytes(seq), batches[seq]))
        await sock.send_multipart((client, b"", b"", seq_bytes(-1), b""))
