"""Cache truth without sockets: KV events → the router's block hashes, wire compatibility with
SGLang's own classes, sequence checks, discovery from /server_info, prediction accuracy."""

from __future__ import annotations

import random

import msgspec
import pytest
from sglang.srt.disaggregation import kv_events as sglang_kv

from omniinfer.emulator.kv_event_publisher import KvEventRecorder, token_hashes
from omniinfer.emulator.radix_cache import RadixCache
from omniinfer.kv_event_wire import (
    Batch,
    Cleared,
    Removed,
    Stored,
    decode_batch,
    dial_endpoint,
    encode_batch,
    parse_kv_events_config,
)
from omniinfer.proxy import cli as router_cli
from omniinfer.proxy.accuracy import Tally, outcome, reported_cached_tokens, reported_from_stream
from omniinfer.proxy.cache_truth import (
    NoEvents,
    parse_endpoint_overrides,
    sources_from_server_info,
)
from omniinfer.proxy.config import RouterConfig
from omniinfer.proxy.prefix import PrefixIndex, block_hashes
from omniinfer.proxy.worker_cache_truth import PageChain, SequenceCheck, WorkerCacheTruth

KEY = "http://w:1"


def _pages(path: list[int], page: int, salt: int = 7) -> list[tuple[int, tuple[int, ...]]]:
    """A worker's view of a token path: (opaque page hash, page tokens), pages of ``page``."""
    out, previous = [], salt
    for start in range(0, len(path), page):
        previous = hash((previous, "page", tuple(path[:start + page])))
        out.append((previous, tuple(path[start:start + page])))
    return out


def _index_blocks(index: PrefixIndex, expected: set[int]) -> bool:
    return index.size(KEY) == len(expected) and all(index.holds(KEY, h) for h in expected)


@pytest.mark.parametrize("page", [1, 3, 4, 16, 32, 40])
def test_page_chain_gives_the_router_hashes_of_each_path(page: int) -> None:
    block = 16
    rng = random.Random(page)
    shared = [rng.randrange(1000) for _ in range(37)]
    paths = [shared + [rng.randrange(1000) for _ in range(n)] for n in (0, 29, 60)]
    index = PrefixIndex()
    truth = WorkerCacheTruth(KEY, index, block)
    known: set[int] = set()
    for path in paths:
        pages = _pages(path, page)
        first_new = next(i for i, (h, _) in enumerate(pages) if h not in known)
        parent = pages[first_new - 1][0] if first_new else None
        new = pages[first_new:]
        # one coalesced event per run of full pages (as SGLang's recorder), the short tail apart
        full = [p for p in new if len(p[1]) == page]
        short = [p for p in new if len(p[1]) != page]
        events = []
        if full:
            events.append(Stored(tuple(h for h, _ in full), parent,
                                 tuple(x for _, t in full for x in t), page))
        if short:
            events.append(Stored((short[0][0],), full[-1][0] if full else parent,
                                 short[0][1], len(short[0][1])))
        truth.apply(0, Batch(0.0, tuple(events), 0, 0))
        known.update(h for h, _ in new)
    expected = {h for path in paths for h in block_hashes(path, block)}
    assert _index_blocks(index, expected)
    matched = index.match(block_hashes(paths[2] + [1, 2, 3], block))
    assert matched[KEY] == len(paths[2]) // block
    # evicting the last path's private pages (leaf first) drops exactly its private blocks
    private = [h for h, _ in _pages(paths[2], page) if h not in {
        h for p in paths[:2] for h, _ in _pages(p, page)}]
    truth.apply(0, Batch(0.0, (Removed(tuple(reversed(private))),), 0, 0))
    kept = {h for path in paths[:2] for h in block_hashes(path, block)}
    assert _index_blocks(index, kept)
    assert index.match(block_hashes(paths[2], block)).get(KEY, 0) == len(shared) // block


def test_orphans_media_namespaces_and_clear() -> None:
    with pytest.raises(ValueError, match="positive"):
        PageChain(0)
    index = PrefixIndex()
    truth = WorkerCacheTruth(KEY, index, 4)
    stored = Stored((11, 12), None, tuple(range(8)), 4)
    truth.apply(0, Batch(0.0, (stored,), 0, 0))
    assert index.size(KEY) == 2
    truth.apply(0, Batch(0.0, (
        Stored((21,), 999, (1, 2, 3, 4), 4),  # parent never seen: dropped, counted
        Stored((31,), 12, (8, 9, 10, 11), 4, medium="CPU_PINNED"),  # host tier: not cached
        Stored((41,), 12, (8, 9, 10, 11), 4, namespaced=True),  # LoRA / salted
        Stored((51,), 12, (1, 2, 3, 4, 5), 4),  # five tokens in one page of 4: malformed
        Removed((777,)),
    ), 0, 0))
    stats = truth.describe()
    assert (stats["orphan_pages"], stats["ignored_events"], stats["malformed_events"],
            stats["unknown_removals"], stats["router_blocks"]) == (1, 2, 1, 1, 2)
    truth.apply(0, Batch(0.0, (Cleared(),), 0, 0))
    assert index.size(KEY) == 0 and truth.describe()["worker_pages"] == 0


def test_two_publishers_of_one_worker_are_counted_apart() -> None:
    index = PrefixIndex()
    truth = WorkerCacheTruth(KEY, index, 2, sources=2)
    event = Stored((5, 6), None, (1, 2, 3, 4), 2)
    truth.apply(0, Batch(0.0, (event,), 0, 0))
    truth.apply(1, Batch(0.0, (event,), 1, 0))
    truth.apply(0, Batch(0.0, (Removed((6, 5)),), 0, 0))
    assert index.size(KEY) == 2  # rank 1 still holds both blocks
    truth.reset(1)
    assert index.size(KEY) == 0


def test_emulated_radix_cache_events_keep_the_index_equal_to_the_tree() -> None:
    """Random inserts and evictions in the emulator's cache, through the wire, into the router:
    the router's blocks are always exactly the blocks of the tree's token paths."""
    rng = random.Random(3)
    recorder = KvEventRecorder()
    tree = RadixCache()
    tree.attach_events(recorder)
    index = PrefixIndex()
    truth = WorkerCacheTruth(KEY, index, 4)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(3, 20))] for _ in range(4)]
    for step in range(120):
        ids = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(0, 15))]
        tree.insert(ids)
        if step % 7 == 0:
            tree.evict(rng.randrange(5, 40))
        if step == 60:
            tree.reset()
        truth.apply(0, decode_batch(encode_batch(0.0, recorder.take())))
        expected = {h for path in _tree_paths(tree) for h in block_hashes(path, 4)}
        assert _index_blocks(index, expected), step


def _tree_paths(tree: RadixCache) -> list[list[int]]:
    out, stack = [], [(tree.root, [])]
    while stack:
        node, path = stack.pop()
        path = path + list(node.key)
        if not node.children and path:
            out.append(path)
        stack.extend((child, path) for child in node.children.values())
    return out


def test_our_batches_decode_with_sglang_classes_and_back() -> None:
    recorder = KvEventRecorder()
    last = recorder.stored(None, [5, 6, 7])
    recorder.stored(last, [8])
    recorder.removed(last, [8])
    recorder.removed(None, [5, 6, 7])  # coalesced into one BlockRemoved, as SGLang does
    recorder.cleared()
    payload = encode_batch(12.5, recorder.take(), 0)
    theirs = msgspec.msgpack.Decoder(type=sglang_kv.KVEventBatch).decode(payload)
    kinds = [type(e).__name__ for e in theirs.events]
    assert kinds == ["BlockStored", "BlockStored", "BlockRemoved", "AllBlocksCleared"]
    first, second, removed = theirs.events[:3]
    assert first.token_ids == [5, 6, 7] and first.parent_block_hash is None
    assert first.block_hashes == token_hashes(None, [5, 6, 7]) and first.block_size == 1
    assert second.parent_block_hash == first.block_hashes[-1] and first.medium == "GPU"
    assert removed.block_hashes == second.block_hashes + first.block_hashes
    assert theirs.ts == 12.5 and theirs.attn_dp_rank == 0
    # SGLang's own encoding, as a real server sends it, decodes with ours
    batch = sglang_kv.KVEventBatch(ts=1.0, attn_dp_rank=1, events=[
        sglang_kv.BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=[9] * 32,
                              block_size=16, lora_id=None, medium=sglang_kv.StorageMedium.GPU),
        sglang_kv.BlockStored(block_hashes=[3], parent_block_hash=2, token_ids=[1], block_size=1,
                              lora_id=None, cache_salt="s"),
        sglang_kv.BlockRemoved(block_hashes=[2]), sglang_kv.AllBlocksCleared()])
    ours = decode_batch(msgspec.msgpack.encode(batch))
    assert ours.dp_rank == 1 and ours.skipped == 0
    assert ours.events[0] == Stored((1, 2), None, tuple([9] * 32), 16, "GPU", False)
    assert ours.events[1].namespaced  # type: ignore[union-attr]
    assert ours.events[2:] == (Removed((2,)), Cleared())


def test_decode_rejects_what_is_not_a_batch() -> None:
    with pytest.raises(ValueError, match="msgpack"):
        decode_batch(b"\xc1")
    with pytest.raises(ValueError, match="array"):
        decode_batch(msgspec.msgpack.encode({"ts": 1}))
    with pytest.raises(ValueError, match="block_size"):
        decode_batch(msgspec.msgpack.encode([0.0, [{"type": "BlockStored", "block_hashes": [1],
                                                    "token_ids": [1], "block_size": 0}], 0]))
    unknown = decode_batch(msgspec.msgpack.encode([0.0, [{"type": "Future"}], 0]))
    assert unknown.skipped == 1 and unknown.events == ()


def test_sequence_check() -> None:
    check = SequenceCheck()
    assert check.classify(5) == "first"
    check.accept(5)
    assert [check.classify(s) for s in (6, 8, 0, 5)] == ["ok", "gap", "restart", "restart"]


def test_kv_events_config_and_endpoints() -> None:
    config = parse_kv_events_config('{"publisher": "zmq", "endpoint": "tcp://*:5557", '
                                    '"topic": "t", "format": "default"}')
    assert config.enabled and config.topic == "t" and config.hwm == 100_000
    assert not parse_kv_events_config("{}").enabled
    for bad, why in (("[1]", "JSON object"), ('{"publisher": "kafka"}', "unknown publisher"),
                     ('{"publisher": "zmq", "endpoint": "ipc:///x"}', "tcp://"),
                     ('{"publisher": "zmq", "endpoint": "tcp://*:0"}', "port"),
                     ('{"hwm": -1}', "positive"), ("{", "JSON")):
        with pytest.raises(ValueError, match=why):
            parse_kv_events_config(bad)
    assert dial_endpoint("tcp://*:5557", "10.0.0.2") == "tcp://10.0.0.2:5557"
    assert dial_endpoint("tcp://0.0.0.0:5557", "::1") == "tcp://[::1]:5557"
    assert dial_endpoint("tcp://10.1.1.1:5557", "10.0.0.2") == "tcp://10.1.1.1:5557"


def test_discovery_from_server_info() -> None:
    sglang_block = {"kv_events": {"publisher": "zmq", "endpoint_host": "*",
                                  "endpoint_port_base": 5557, "topic": "kv", "block_size": 1,
                                  "dp_size": 2, "replay_endpoint_port_base": 6000}}
    sources, page = sources_from_server_info(sglang_block, "w1")
    assert [(s.endpoint, s.topic, s.replay) for s in sources] == [
        ("tcp://w1:5557", "kv", "tcp://w1:6000"), ("tcp://w1:5558", "kv", "tcp://w1:6001")]
    assert page == 1
    config_only = {"kv_events": None, "page_size": 16, "dp_size": 1,
                   "kv_events_config": '{"publisher": "zmq", "endpoint": "tcp://*:7000"}'}
    sources, page = sources_from_server_info(config_only, "w2")
    assert [s.endpoint for s in sources] == ["tcp://w2:7000"] and page == 16
    for info, why in (({"kv_events_config": None}, "--kv-events-config"),
                      ({"kv_events_config": '{"publisher": "null"}'}, "null"), (None, "answer")):
        with pytest.raises(NoEvents, match=why):
            sources_from_server_info(info, "w")
    assert parse_endpoint_overrides(["w:1=tcp://h:1", "http://w:1/=tcp://h:2"]) == {
        "http://w:1": ["tcp://h:1", "tcp://h:2"]}


def test_router_flags_are_validated(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="needs --cache-truth kv-events"):
        RouterConfig(worker_urls=["http://w:1"], kv_events_endpoints=["w:1=tcp://h:1"]).validate()
    with pytest.raises(ValueError, match="WORKER_URL=tcp"):
        RouterConfig(cache_truth="kv-events", kv_events_endpoints=["tcp://h:1"]).validate()
    assert router_cli.main(["--worker-urls", "http://w:1", "--kv-events-endpoint",
                            "http://w:1=udp://h:1", "--cache-truth", "kv-events"]) == 2
    assert "not tcp://HOST:PORT" in capsys.readouterr().err


def test_reported_cached_tokens_and_outcomes() -> None:
    assert reported_cached_tokens(b'{"text": "a", "meta_info": {"cached_tokens": 12}}') == 12
    assert reported_cached_tokens(b'[{"meta_info": {"cached_tokens": 3}}]') == 3
    openai = (b'data: {"choices": [{"text": "a"}], "usage": null}\n\n'
              b'data: {"choices": [], "usage": {"prompt_tokens": 9, '
              b'"prompt_tokens_details": {"cached_tokens": 8}}}\n\ndata: [DONE]\n\n')
    assert reported_cached_tokens(openai) == 8
    cut = b'ta_info": {"cached_tokens": 1}}\n\ndata: {"meta_info": {"cached_tokens": 40}}\n\n'
    assert reported_cached_tokens(cut) == 40
    assert reported_cached_tokens(b'{"usage": {"prompt_tokens_details": null}}') is None
    assert reported_from_stream(b'data: {"meta_info": {"cached_tokens": 5}}\n\n', b"xx") == 5
    assert [outcome(p, r, 16) for p, r in ((32, 32), (32, 47), (32, 48), (48, 40), (0, 3))] == [
        "exact", "exact", "under", "over", "exact"]
    tally = Tally()
    for predicted, reported in ((16, 20), (32, 10), (0, 16), (5, None)):
        tally.add(predicted, reported, 16)
    summary = tally.as_dict()
    assert (summary["exact"], summary["over"], summary["under"], summary["unreported"],
            summary["abs_error_tokens"], summary["measured"]) == (1, 1, 1, 1, 42, 3)
