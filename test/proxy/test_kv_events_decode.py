"""The KV-event fast paths: typed decoding agrees with the tolerant decoder, and page runs keep
the router's blocks right when pages are stored again or removed out of order."""

from __future__ import annotations

import random

import msgspec
import pytest

from omniinfer.emulator.kv_event_publisher import KvEventRecorder
from omniinfer.emulator.radix_cache import RadixCache
from omniinfer.kv_event_wire import (
    Batch,
    ProtocolError,
    Removed,
    Stored,
    _tolerant,
    _typed,
    decode_batch,
    encode_batch,
)
from omniinfer.proxy.prefix import PrefixIndex, block_hashes
from omniinfer.proxy.worker_cache_truth import WorkerCacheTruth

KEY = "http://w:1"


def _emulated_payloads(seed: int) -> list[bytes]:
    rng = random.Random(seed)
    recorder = KvEventRecorder()
    tree = RadixCache(capacity=400)
    tree.attach_events(recorder)
    shared = [rng.randrange(100) for _ in range(40)]
    out = []
    for _ in range(60):
        tree.insert(shared[:rng.randrange(5, 40)] + [rng.randrange(100) for _ in range(30)])
        out.append(encode_batch(1.5, recorder.take()))
    tree.reset()
    out.append(encode_batch(2.0, recorder.take()))
    return out


def test_typed_and_tolerant_decoders_agree_on_what_the_emulator_sends() -> None:
    payloads = _emulated_payloads(0)
    kinds = set()
    for payload in payloads:
        fast = _typed(payload)
        assert fast is not None and fast == _tolerant(payload)
        kinds.update(type(e).__name__ for e in fast.events)
    assert kinds == {"Stored", "Removed", "Cleared"}  # the capacity made the tree evict


def _raw(events: list[dict[str, object]]) -> bytes:
    return msgspec.msgpack.encode([1.0, events, 0])


STORED = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
          "token_ids": [5, 6], "block_size": 1, "lora_id": None}


def test_what_the_typed_schema_refuses_goes_the_tolerant_way() -> None:
    # an unknown event type beside a known one: skipped and counted, the known one kept
    batch = decode_batch(_raw([STORED, {"type": "BlockMoved", "block_hashes": [1]}]))
    assert batch.skipped == 1 and batch.events == (Stored((1, 2), None, (5, 6), 1),)
    # fields that mark another namespace make the pages unusable for plain prompts
    for field in ("lora_id", "lora_name", "cache_salt"):
        event = decode_batch(_raw([{**STORED, field: 3 if field == "lora_id" else "x"}])).events[0]
        assert isinstance(event, Stored) and event.namespaced, field
    # bigram pages (EAGLE): namespaced, no tokens
    bigram = decode_batch(_raw([{**STORED, "token_ids": [[5, 6], [6, 7]]}])).events[0]
    assert isinstance(bigram, Stored) and bigram.namespaced and bigram.tokens == ()
    for bad, message in (({**STORED, "block_hashes": [True, 2]}, "block_hashes"),
                         ({**STORED, "block_size": 0}, "block_size"),
                         ({**STORED, "parent_block_hash": "p"}, "parent_block_hash")):
        assert _typed(_raw([bad])) is None
        with pytest.raises(ProtocolError, match=message):
            decode_batch(_raw([bad]))


def _apply(truth: WorkerCacheTruth, *events: object) -> None:
    truth.apply(0, Batch(0.0, tuple(events), 0, 0))  # type: ignore[arg-type]


def test_a_store_repeated_or_overlapping_counts_each_page_once() -> None:
    index = PrefixIndex()
    truth = WorkerCacheTruth(KEY, index, 4)
    tokens = tuple(range(100, 112))
    first = Stored((1, 2, 3, 4, 5, 6), None, tokens[:6], 1)
    _apply(truth, first, first)  # a replay of the same batch
    assert index.size(KEY) == 1 and truth.describe()["worker_pages"] == 6
    # the replay of a longer store: pages 1-6 known, 7-12 new, one event
    _apply(truth, Stored(tuple(range(1, 13)), None, tokens, 1))
    assert all(index.holds(KEY, h) for h in block_hashes(tokens, 4))
    assert index.size(KEY) == 3 and truth.describe()["worker_pages"] == 12
    # removing pages in any order releases the block each last page ends, and nothing else
    _apply(truth, Removed((8, 12)))
    assert index.size(KEY) == 1 and index.holds(KEY, block_hashes(tokens, 4)[0])
    _apply(truth, Removed((1, 2, 3, 5, 6, 7, 9, 10, 11)))
    assert index.size(KEY) == 1  # page 4 still holds the first block
    _apply(truth, Removed((4,)))
    assert truth.blocks() == 0 and truth.describe()["worker_pages"] == 0


def test_child_of_a_page_in_the_middle_of_a_run() -> None:
    """A radix split makes a page inside an earlier run the parent of a new run."""
    index = PrefixIndex()
    truth = WorkerCacheTruth(KEY, index, 4)
    trunk = tuple(range(10))
    _apply(truth, Stored(tuple(range(1, 11)), None, trunk, 1))
    branch = (50, 51, 52, 53, 54)
    _apply(truth, Stored(tuple(range(21, 26)), 6, branch, 1))  # after trunk[:6]
    path = trunk[:6] + branch
    assert index.match(block_hashes(path, 4))[KEY] == 2
    assert truth.blocks() == len(set(block_hashes(trunk, 4)) | set(block_hashes(path, 4)))


def test_sent_blocks_count_until_the_worker_reports_them_or_their_deadline() -> None:
    index = PrefixIndex()
    truth = WorkerCacheTruth(KEY, index, 4, pending_s=10.0)
    tokens = tuple(range(200, 212))
    blocks = block_hashes(tokens, 4)
    truth.expect(blocks, now=0.0)  # routed there, prefill not done: the next request sees it
    assert index.match(blocks)[KEY] == 3 and truth.describe()["pending_blocks"] == 3
    _apply(truth, Stored(tuple(range(1, 9)), None, tokens[:8], 1))  # the worker stored 2 blocks
    assert truth.describe()["pending_blocks"] == 1
    truth.expire(10.0)  # the third never came: dropped at its deadline; the stored two stay
    assert index.match(blocks)[KEY] == 2 and truth.describe()["expired_pending_blocks"] == 1
    # sent again before the deadline: the later deadline holds
    truth.expect(blocks, now=11.0)
    truth.expect(blocks, now=15.0)
    truth.expire(21.0)
    assert index.match(blocks)[KEY] == 3
    truth.expire(25.0)
    assert index.match(blocks)[KEY] == 2
    # a reset of every source (the worker was flushed) forgets what was sent too
    truth.expect(blocks, now=30.0)
    truth.reset()
    assert index.size(KEY) == 0 and truth.describe()["pending_blocks"] == 0
