"""SGLang's runtime-load feed without servers: the wire format against SGLang 0.5.23's own
``LoadStat``, the endpoint resolution against SGLang's own resolver, and the publisher and the
router's subscriber talking over a real ZMQ socket in one process."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import pytest
import zmq.asyncio
from sglang.srt.disaggregation.kv_events import resolve_load_pub_range
from sglang.srt.managers.scheduler_components.load_publisher import LoadStat as SGLangLoadStat

from omniinfer.child_process import free_port
from omniinfer.emulator.load_publisher import LoadPublisher
from omniinfer.kv_event_wire import ProtocolError, parse_kv_events_config
from omniinfer.load_feed_wire import LoadStat, decode_load, encode_load, resolve_load_endpoint
from omniinfer.proxy import load_subscriber as router_feed
from omniinfer.proxy.load_subscriber import (
    NoFeed,
    RankFeed,
    WorkerFeed,
    feed_endpoints,
    merged_loads,
)
from omniinfer.proxy.workers import Role, Worker, WorkerLoads


def test_our_encoding_is_sglangs_byte_for_byte() -> None:
    for values in [(1, 2, 300, 4096), (0, 0, 0, 0, 0, 5, 6, 7, 8, 9), (3, 1, 70, 512, None)]:
        assert encode_load(LoadStat(*values)) == msgspec.msgpack.encode(SGLangLoadStat(*values))
        assert decode_load(msgspec.msgpack.encode(SGLangLoadStat(*values))) == LoadStat(*values)


def test_decoder_takes_the_old_short_form_and_ignores_appended_fields() -> None:
    assert decode_load(msgspec.msgpack.encode(["LoadStat", 1, 2, 3, 4])) == LoadStat(1, 2, 3, 4)
    longer = msgspec.msgpack.encode(["LoadStat", *range(10), 99, "new"])
    assert decode_load(longer) == LoadStat(0, 1, 2, 3, 4, 5, 6, 7, 8, 9)


@pytest.mark.parametrize("payload, words", [
    (b"\xc1", "not msgpack"),
    (msgspec.msgpack.encode({"num_running_reqs": 1}), "not a LoadStat"),
    (msgspec.msgpack.encode(["KVEventBatch", 1, 2, 3, 4]), "not a LoadStat"),
    (msgspec.msgpack.encode(["LoadStat", 1, 2, 3]), "3 fields"),
    (msgspec.msgpack.encode(["LoadStat", 1, -2, 3, 4]), "num_waiting_reqs"),
    (msgspec.msgpack.encode(["LoadStat", 1, 2, True, 4]), "num_tokens"),
    (msgspec.msgpack.encode(["LoadStat", 1, 2, 3, 4.5]), "max_total_num_tokens"),
])
def test_decoder_rejects_what_is_not_a_reading(payload: bytes, words: str) -> None:
    with pytest.raises(ProtocolError, match=words):
        decode_load(payload)


@pytest.mark.parametrize("value, kv, replay, dp", [
    ("auto", "tcp://*:5557", None, 1),
    ("auto", "tcp://*:5557", "tcp://*:5558", 1),  # the replay socket takes kv + 1
    ("auto", "tcp://*:5557", None, 4),
    ("auto", "tcp://0.0.0.0:6000", "tcp://*:6005", 2),
    ("tcp://*:7000", "tcp://*:5557", None, 1),
    ("tcp://*:5558", "tcp://*:5557", None, 2),  # overlaps rank 1's KV port
    ("tcp://127.0.0.1:7000", "tcp://*:5557", None, 1),  # a concrete host is connected to
    ("auto", "tcp://*:65535", None, 1),  # past the last port
    ("off", "tcp://*:5557", None, 1),
    (None, "tcp://*:5557", None, 1),
])
def test_resolution_agrees_with_sglang(value: str | None, kv: str, replay: str | None,
                                       dp: int) -> None:
    theirs, _ = resolve_load_pub_range(kv_endpoint=kv, replay_endpoint=replay, dp_size=dp,
                                       load_publish_endpoint=value)
    config = parse_kv_events_config({"publisher": "zmq", "endpoint": kv,
                                     "replay_endpoint": replay})
    try:
        ours = resolve_load_endpoint(value, config, dp)
    except ValueError:
        ours = None
    assert (None if ours is None else ours[1]) == (None if theirs is None else theirs[1])


def test_resolution_names_why_it_cannot_work() -> None:
    with pytest.raises(ValueError, match="needs --kv-events-config"):
        resolve_load_endpoint("auto", None)
    with pytest.raises(ValueError, match="needs --kv-events-config"):
        resolve_load_endpoint("auto", parse_kv_events_config({"publisher": "null"}))
    zmq_config = parse_kv_events_config({"publisher": "zmq", "endpoint": "tcp://*:5557"})
    with pytest.raises(ValueError, match="wildcard"):
        resolve_load_endpoint("tcp://10.0.0.1:7000", zmq_config)
    with pytest.raises(ValueError, match="overlap"):
        resolve_load_endpoint("tcp://*:5557", zmq_config)


def _info(**block: Any) -> dict[str, Any]:
    return {"kv_events": {"publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": 5557,
                          "topic": "", "block_size": 1, "dp_size": 1, **block}}


def test_endpoints_come_from_server_info_on_the_workers_own_host() -> None:
    assert feed_endpoints(_info(load_endpoint_port_base=5558, load_topic="load"), "10.1.2.3") \
        == (["tcp://10.1.2.3:5558"], "load")
    assert feed_endpoints(_info(load_endpoint_port_base=6000, dp_size=2), "h")[0] \
        == ["tcp://h:6000", "tcp://h:6001"]
    with pytest.raises(NoFeed, match="no KV events"):
        feed_endpoints({"kv_events": None}, "h")
    with pytest.raises(NoFeed, match="--load-publish-endpoint"):
        feed_endpoints(_info(), "h")
    with pytest.raises(NoFeed, match="not the worker's host"):
        feed_endpoints(_info(load_endpoint_port_base=5558, endpoint_host="10.9.9.9"), "10.1.2.3")
    with pytest.raises(NoFeed, match="dp_size"):
        feed_endpoints(_info(load_endpoint_port_base=5558, dp_size=1000), "h", max_ranks=64)
    with pytest.raises(NoFeed, match="port"):
        feed_endpoints(_info(load_endpoint_port_base=65535, dp_size=2), "h")


def test_ranks_add_up_and_throughput_is_kept() -> None:
    a, b = RankFeed("a", LoadStat(2, 1, 100, 1000, 0, 40, 100, 8, 500, 7000)), RankFeed("b")
    b.last = LoadStat(1, 3, 600, 1000, 1, 60, 600, 8, 300, 3000)
    loads = merged_loads([a, b], WorkerLoads(gen_throughput=12.5))
    assert (loads.running_reqs, loads.waiting_reqs, loads.used_tokens) == (3, 4, 700)
    assert (loads.waiting_uncached_tokens, loads.max_total_tokens) == (100, 2000)
    assert (loads.prefill_uncached_tokens, loads.prefill_busy_us) == (800, 10000)
    assert loads.max_running_reqs == 16 and loads.token_usage == pytest.approx(0.6)
    assert loads.gen_throughput == 12.5


def test_publisher_and_subscriber_over_zmq(monkeypatch: pytest.MonkeyPatch) -> None:
    """Readings reach worker.loads and the policy; an unchanged one is not resent before the
    heartbeat; a silent feed goes stale; during a pass the watcher stays quiet."""

    async def scenario() -> None:
        port = free_port()
        reading = {"stat": LoadStat(0, 0, 0, 4096)}
        passing = {"now": False}
        publisher = LoadPublisher("127.0.0.1", port, lambda: reading["stat"],
                                  passing=lambda: passing["now"], decode_interval=3)
        publisher.start()
        worker = Worker("http://127.0.0.1:1", Role.PREFILL)
        heard: list[WorkerLoads] = []
        ctx = zmq.asyncio.Context()
        feed = WorkerFeed(worker, [f"tcp://127.0.0.1:{port}"], "load",
                          lambda w: heard.append(w.loads))
        try:
            for _ in range(100):  # the slow joiner: wait for the heartbeat to get through
                if feed.live(_now()):
                    break
                await asyncio.sleep(0.05)
            assert feed.live(_now()) and heard
            passing["now"] = True  # inside a pass: a change waits for the pass's end
            reading["stat"] = LoadStat(0, 5, 0, 4096, 0, 900)
            await asyncio.sleep(0.2)
            assert worker.loads.waiting_reqs == 0
            publisher.after_pass("prefill")  # a prefill pass publishes at once
            await _until(lambda: worker.loads.waiting_reqs == 5)
            assert worker.loads.waiting_uncached_tokens == 900
            sent = publisher.next_seq
            assert not publisher.publish()  # unchanged: not before the heartbeat
            reading["stat"] = LoadStat(3, 0, 1200, 4096)
            publisher.after_pass("decode")
            publisher.after_pass("decode")
            assert publisher.next_seq == sent  # decode: every third pass only
            publisher.after_pass("decode")
            await _until(lambda: worker.loads.running_reqs == 3)
            assert worker.loads.used_tokens == 1200
            assert worker.loads.token_usage == pytest.approx(1200 / 4096)
            await publisher.close()
            monkeypatch.setattr(router_feed, "STALE_AFTER_S", 0.3)
            await asyncio.sleep(0.5)
            assert not feed.live(_now())
            assert feed.describe()["load_source"] == "poll (feed stale)"
        finally:
            await feed.close()
            ctx.destroy(linger=0)

    asyncio.run(scenario())


def _now() -> float:
    return time.monotonic()


async def _until(predicate: Any, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


def test_a_malformed_message_is_counted_and_skipped() -> None:
    worker = Worker("http://127.0.0.1:1", Role.DECODE)

    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        feed = WorkerFeed(worker, ["tcp://127.0.0.1:1"], "load", lambda w: None)
        rank = feed.ranks[0]
        feed._apply(rank, [b"load", b"\x00" * 8])
        feed._apply(rank, [b"load", b"\x00" * 8, b"\xc1"])
        feed._apply(rank, [b"load", (7).to_bytes(8, "big"), encode_load(LoadStat(1, 0, 9, 99))])
        assert rank.malformed == 2 and rank.readings == 1 and rank.last_seq == 7
        assert worker.loads.running_reqs == 1 and worker.loads.used_tokens == 9
        await feed.close()
        ctx.destroy(linger=0)

    asyncio.run(scenario())
