"""The router's per-request shortcuts give the answers of the plain code they replace: lock-free
metric families expose what prometheus_client's own would, the bitmask prefix index matches a
set-per-block reference, memoised OAS predictions equal the model's, the approximate tokenizer
equals its 4-byte definition, and the access log writes any record the router accepted."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from omniinfer.proxy.metrics import LATENCY_BUCKETS, AccessLog, FastCounter, FastHistogram
from omniinfer.proxy.oas.cost import BatchTimeModel
from omniinfer.proxy.oas.deferred_policy import MemoModel
from omniinfer.proxy.prefix import PrefixIndex
from omniinfer.proxy.tokenization import ApproxTokenizer


def test_fast_metric_families_expose_what_prometheus_client_would() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    fast_h = FastHistogram("x_seconds", "doc", LATENCY_BUCKETS, ["phase"])
    fast_c = FastCounter("x_requests", "doc", ["endpoint", "status"])
    ours.register(fast_h)
    ours.register(fast_c)
    slow_h = Histogram("x_seconds", "doc", ["phase"], buckets=LATENCY_BUCKETS, registry=theirs)
    slow_c = Counter("x_requests", "doc", ["endpoint", "status"], registry=theirs)
    rng = random.Random(7)
    values = [*LATENCY_BUCKETS, 0.0, 1e9] + [rng.expovariate(20.0) for _ in range(500)]
    for i, value in enumerate(values):  # bucket bounds themselves must land in their own bucket
        phase = ("tokenize", "apc_matching")[i % 2]
        fast_h.child(phase).observe(value)
        slow_h.labels(phase).observe(value)
        fast_c.inc(("generate", str(200 + i % 3)), 1.0)
        slow_c.labels("generate", str(200 + i % 3)).inc()

    def lines(registry: CollectorRegistry) -> list[str]:
        return sorted(line for line in generate_latest(registry).decode().splitlines()
                      if "_created" not in line)

    assert lines(ours) == lines(theirs)


class _SetIndex:
    """The index as it was: a set of owners per block (the reference for the bitmask one)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.blocks: dict[str, list[int]] = {}

    def insert(self, key: str, hashes: list[int]) -> None:
        held = self.blocks.setdefault(key, [])
        for h in hashes:
            if h in held:
                held.remove(h)
            held.append(h)
        del held[:max(0, len(held) - self.cap)]

    def remove(self, key: str, hashes: list[int]) -> None:
        held = self.blocks.get(key, [])
        self.blocks[key] = [h for h in held if h not in hashes]

    def match(self, hashes: list[int]) -> dict[str, int]:
        out = {}
        for key, held in self.blocks.items():
            depth = 0
            while depth < len(hashes) and hashes[depth] in held:
                depth += 1
            if depth:
                out[key] = depth
        return out


@pytest.mark.parametrize("workers", [3, 80])  # 80: masks wider than a machine word
def test_bitmask_prefix_index_matches_a_set_per_block(workers: int) -> None:
    rng = random.Random(workers)
    cap = 25
    index, reference = PrefixIndex(cap), _SetIndex(cap)
    keys = [f"http://10.0.{i // 250}.{i % 250}:1" for i in range(workers)]
    pool = [rng.getrandbits(62) for _ in range(60)]
    for _ in range(3000):
        key, hashes, roll = rng.choice(keys), rng.sample(pool, rng.randint(0, 8)), rng.random()
        if roll < 0.6:
            index.insert(key, hashes)
            reference.insert(key, hashes)
        elif roll < 0.8:
            index.remove(key, hashes)
            reference.remove(key, hashes)
        elif roll < 0.83:  # a removed worker: its bit is freed and reused by the next one
            index.clear(key)
            reference.blocks.pop(key, None)
        query = rng.sample(pool, rng.randint(1, 12))
        assert index.match(query) == reference.match(query)
        assert index.size(key) == len(reference.blocks.get(key, []))
    assert index.distinct() == len({h for held in reference.blocks.values() for h in held})


def test_memoised_predictions_equal_the_models_through_learning() -> None:
    plain, memo = BatchTimeModel(), MemoModel()
    rng = random.Random(3)
    for step in range(200):
        tokens = [rng.randint(1, 4000) for _ in range(rng.randint(1, 3))]
        if step % 7 == 0:
            plain.update(tokens, 0.01 + 1e-5 * sum(tokens))
            memo.update(tokens, 0.01 + 1e-5 * sum(tokens))
        if step == 50:
            plain.seed_per_token(20.0, 1 << 20)
            memo.seed_per_token(20.0, 1 << 20)
        one = [rng.choice((5, 100, 2000))]  # asked again and again, as routing does
        assert memo.predict(one) == plain.predict(one)
        assert memo.predict(tokens) == plain.predict(tokens)


def test_approximate_tokens_are_little_endian_4_byte_chunks() -> None:
    rng = random.Random(5)
    texts = ["", "a", "abcd", "abcde", "héllo wörld ✓", "\ud800 lone surrogate"] + [
        "".join(chr(rng.randint(32, 0x2FFF)) for _ in range(rng.randint(1, 300)))
        for _ in range(50)]
    for text in texts:
        data = text.encode("utf-8", "surrogatepass")
        expected = [int.from_bytes(data[i:i + 4], "little") for i in range(0, len(data), 4)]
        assert ApproxTokenizer().encode(text) == expected


def test_access_log_writes_a_client_rid_nested_to_the_body_limit(tmp_path: Path) -> None:
    rid: object = "x"
    for _ in range(253):  # the deepest rid a body may carry (forward.py re-encodes bodies)
        rid = [rid]
    log = AccessLog(str(tmp_path / "access.jsonl"))
    log.write({"id": "r1", "client_rid": rid, "status": 200})
    log.write({"id": "r2", "status": 200, "e2e": float("nan")})
    log.close()
    records = [json.loads(line) for line in (tmp_path / "access.jsonl").read_text().splitlines()]
    assert [r["id"] for r in records] == ["r1", "r2"]
