"""The sink-aware radix tree on SGLang's real objects with tiny pools (no server).

``UnifiedRadixCache`` with :class:`SinkSWAComponent` over a real ``SWAKVPool`` /
``SWATokenToKVPoolAllocator``; requests are played as the scheduler plays them (match, lock,
allocate, slide the window, insert, unlock). After every tree operation the two pools must
balance (free + evictable + protected + slots held by running requests = capacity), every
match must be one :func:`radix_sink.reusable` accepts on the allocator's real slot map, and
every running request must still find its sink and window. The stock ``SWAComponent``
fails the same checks (guard tests), so they can fail.
"""

from __future__ import annotations

import random
from array import array
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from omniinfer.cpu import import_shims

import_shims.install()

from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import (  # noqa: E402
    EvictParams,
    InsertParams,
    MatchPrefixParams,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool  # noqa: E402
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType  # noqa: E402
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache  # noqa: E402

from omniinfer.attn import radix_sink  # noqa: E402
from omniinfer.sglang_plugin.omni_attn import radix  # noqa: E402

SINK, RECENT = 8, 16
WINDOW = RECENT - 1
SWA = ComponentType.SWA


def _key(tokens: list[int]) -> RadixKey:
    return RadixKey(array("q", tokens))


@dataclass
class Running:
    tokens: list[int]
    prefix: int
    row: torch.Tensor  # full slots of every position
    lock: Any
    evicted: int = 0  # own compressed slots [max(prefix, sink), evicted) are freed
    own: list[int] = field(default_factory=list)


class Tree:
    """One tiny hybrid pool and a radix cache over it, played like the scheduler plays it."""

    def __init__(self, sink_rules: bool = True, full: int = 600, swa: int = 200) -> None:
        radix.configure(SINK)
        kv = SWAKVPool(size=full, size_swa=swa, page_size=1, dtype=torch.float32, head_num=1,
                       head_dim=4, v_head_dim=4, swa_attention_layer_ids=[0],
                       full_attention_layer_ids=[1], device="cpu", enable_memory_saver=False)
        self.alloc = SWATokenToKVPoolAllocator(full, swa, 1, torch.float32, "cpu", kv,
                                               need_sort=False)
        override = radix.component_overrides() if sink_rules else None
        params = CacheInitParams(
            disable=False, page_size=1, sliding_window_size=WINDOW,
            req_to_token_pool=ReqToTokenPool(size=4, max_context_len=256, device="cpu",
                                             enable_memory_saver=False),
            token_to_kv_pool_allocator=self.alloc,
            tree_components=(ComponentType.FULL, SWA), component_registry_override=override,
            tree_core_backend="python",
        )
        self.cache = UnifiedRadixCache(params)
        self.running: list[Running] = []

    # ---- what the scheduler does

    def alive(self, slots: torch.Tensor) -> list[bool]:
        return (self.alloc.full_to_swa_index_mapping[slots.to(torch.int64)] > 0).tolist()

    def match(self, tokens: list[int]) -> tuple[int, torch.Tensor, Any]:
        result = self.cache.match_prefix(MatchPrefixParams(key=_key(tokens)))
        prefix = result.device_prefix_len
        slots = self.cache.path_device_indices(result.last_device_node)[:prefix]
        assert radix_sink.reusable(self.alive(slots), prefix, SINK, RECENT), prefix
        return prefix, slots, result.last_device_node

    def start(self, tokens: list[int]) -> Running | None:
        prefix, slots, node = self.match(tokens)
        lock = self.cache.lock(node)
        need = len(tokens) - prefix
        if self.alloc.full_available_size() < need or self.alloc.swa_available_size() < need:
            self.cache.evict(EvictParams(num_tokens=need, swa_num_tokens=need))
        new = self.alloc.alloc(need) if need else torch.empty(0, dtype=torch.int64)
        if new is None:
            self.cache.unlock(lock)
            return None
        req = Running(tokens, prefix, torch.cat([slots, new.to(torch.int64)]), lock)
        self.running.append(req)
        return req

    def slide(self, req: Running, upto: int) -> None:
        """The request's window eviction: free its own compressed slots below ``upto``."""
        lo = max(req.prefix, SINK, req.evicted)
        if upto > lo:
            self.alloc.free_swa_segment(req.row[lo:upto], start_pos=lo)
            req.evicted = upto

    def finish(self, req: Running) -> None:
        params = InsertParams(key=_key(req.tokens), value=req.row.clone(),
                              prev_prefix_len=req.prefix)
        params.set_evicted_seqlen(SWA, req.evicted)
        self.cache.insert(params)
        self.cache.unlock(req.lock)
        self.running.remove(req)

    # ---- the checks

    def held(self) -> tuple[int, int]:
        """Slots running requests hold outside the tree: (full, compressed)."""
        full = sum(len(r.tokens) - r.prefix for r in self.running)
        swa = sum(sum(self.alive(r.row[r.prefix:])) for r in self.running)
        return full, swa

    def check_ledger(self) -> None:
        book = radix.ledger(self.cache)
        held_full, held_swa = self.held()
        full, comp = book["full"], book["compressed"]
        assert full["free"] + full["evictable"] + full["protected"] + held_full == full["capacity"]
        assert comp["free"] + comp["evictable"] + comp["protected"] + held_swa == comp["capacity"], (
            book, held_swa)

    def check_running_reads(self) -> None:
        for r in self.running:
            n = len(r.tokens)
            needed = radix_sink.reusable(self.alive(r.row), n, SINK, RECENT)
            assert needed, f"a running request lost its sink or window (prefix {r.prefix})"


def _play(tree: Tree, tokens: list[int], evicted: int) -> Running:
    req = tree.start(tokens)
    assert req is not None
    tree.slide(req, evicted)
    tree.finish(req)
    return req


def test_the_python_tree_core_runs_the_sink_component() -> None:
    tree = Tree()
    assert type(tree.cache.tree_core).__name__ == "UnifiedTreeCore"
    assert isinstance(tree.cache.components[SWA], radix.SinkSWAComponent)
    assert radix.describe(tree.cache)["sink_rules"] is True


def test_a_cache_on_another_tree_core_is_refused() -> None:
    tree = Tree()
    radix.require_python_core(tree.cache)  # the real cache passes

    class RustLike:  # stands for the Rust core: not SGLang's Python UnifiedTreeCore
        pass

    tree.cache.tree_core = RustLike()
    with pytest.raises(RuntimeError, match="Python radix tree core.*RustLike"):
        radix.require_python_core(tree.cache)


def test_insert_keeps_the_sink_live_and_owned() -> None:
    tree = Tree()
    tokens = list(range(100, 160))
    _play(tree, tokens, evicted=40)
    tree.check_ledger()
    assert tree.cache.swa_evictable_size() == SINK + 20  # sink + [40, 60)
    assert tree.match(tokens)[0] == 60
    # Diverging at 30: the window above 30 is gone, the sink alone is reusable.
    assert tree.match(tokens[:30] + [1, 2, 3])[0] == SINK
    assert radix.stats()["sink_nodes_stored"] >= 1


def test_a_duplicate_sink_is_freed_on_both_sides() -> None:
    tree = Tree()
    tokens = list(range(100, 160))
    first, second = tree.start(tokens), tree.start(tokens)  # both admitted before either ends
    assert first is not None and second is not None and second.prefix == 0
    for req in (first, second):
        tree.slide(req, 40)
    tree.finish(first)
    tree.check_ledger()
    tree.finish(second)
    tree.check_ledger()
    assert radix.stats()["duplicate_sink_slots_freed"] == SINK


def test_pressure_never_takes_a_running_requests_sink() -> None:
    tree = Tree()
    prompt = list(range(1000, 1050))
    _play(tree, prompt + [1, 2], evicted=45)
    req = tree.start(prompt + [7, 8, 9])
    assert req is not None and req.prefix == SINK  # the window at 50 was not kept
    tree.slide(req, 35)
    for i in range(6):  # other prefixes, then squeeze the compressed pool dry
        _play(tree, [2000 + 100 * i + t for t in range(40)], evicted=20)
    tree.cache.evict(EvictParams(num_tokens=0, swa_num_tokens=10_000))
    tree.check_ledger()
    tree.check_running_reads()
    assert radix.stats()["sink_pins"] > 0  # the request's full lock pinned its sink
    assert radix.stats()["sink_splits"] + radix.stats()["sink_subtree_leaves"] > 0
    tree.finish(req)
    tree.cache.evict(EvictParams(num_tokens=10_000, swa_num_tokens=10_000))
    book = radix.ledger(tree.cache)
    assert book["full"]["free"] == book["full"]["capacity"]
    assert book["compressed"]["free"] == book["compressed"]["capacity"]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_random_traffic_balances_after_every_operation(seed: int) -> None:
    rng = random.Random(seed)
    tree = Tree()
    prompts = [[10_000 * (p + 1) + t for t in range(rng.randint(20, 50))] for p in range(3)]
    matched = 0
    for _ in range(120):
        op = rng.random()
        if op < 0.45 and len(tree.running) < 3:
            tokens = rng.choice(prompts) + [rng.randint(0, 50) for _ in range(rng.randint(3, 30))]
            req = tree.start(tokens)
            matched += bool(req and req.prefix > SINK)
        elif op < 0.85 and tree.running:
            req = rng.choice(tree.running)
            tree.slide(req, rng.randint(0, max(0, len(req.tokens) - WINDOW)))
            tree.check_running_reads()
            if rng.random() < 0.6:
                tree.finish(req)
        else:
            tree.cache.evict(EvictParams(num_tokens=rng.randint(0, 80),
                                         swa_num_tokens=rng.randint(0, 80)))
        tree.check_ledger()
        tree.check_running_reads()
    assert matched > 0  # prefixes past the sink were reused, so matching was exercised


def test_stock_component_leaks_the_sink() -> None:
    """Guard: SGLang's own SWA component fails the ledger the tests above check, and a
    duplicate sink's compressed slots never come back, even with the tree emptied."""
    tree = Tree(sink_rules=False)
    tokens = list(range(100, 160))
    first, second = tree.start(tokens), tree.start(tokens)
    assert first is not None and second is not None
    for req in (first, second):
        tree.slide(req, 40)
    tree.finish(first)
    with pytest.raises(AssertionError):
        tree.check_ledger()  # the sink's compressed slots belong to no node
    tree.finish(second)
    tree.cache.evict(EvictParams(num_tokens=10_000, swa_num_tokens=10_000))
    book = radix.ledger(tree.cache)
    assert book["full"]["free"] == book["full"]["capacity"]
    assert book["compressed"]["free"] == book["compressed"]["capacity"] - 2 * SINK  # both sinks


def _evict_all_compressed(tree: Tree) -> None:
    """Admission's promise: what the ledger calls evictable, an eviction frees."""
    book = radix.ledger(tree.cache)["compressed"]
    promised = book["free"] + book["evictable"]
    tree.cache.evict(EvictParams(num_tokens=0, swa_num_tokens=book["evictable"]))
    after = radix.ledger(tree.cache)["compressed"]
    assert after["free"] >= promised, (book, after)


def test_a_running_requests_sink_is_not_counted_evictable() -> None:
    tree = Tree()
    prompt = list(range(1000, 1050))
    _play(tree, prompt, evicted=30)
    req = tree.start(prompt + [7, 8, 9])  # locks the cached path, sink node included
    assert req is not None and req.prefix == len(prompt)
    tree.slide(req, 40)
    _evict_all_compressed(tree)
    tree.check_ledger()
    tree.check_running_reads()
    tree.finish(req)
    _evict_all_compressed(tree)
    assert radix.ledger(tree.cache)["compressed"]["evictable"] == 0


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_random_traffic_evictable_is_what_eviction_frees(seed: int) -> None:
    rng = random.Random(100 + seed)
    tree = Tree()
    prompts = [[10_000 * (p + 1) + t for t in range(rng.randint(20, 50))] for p in range(3)]
    for _ in range(100):
        if rng.random() < 0.5 and len(tree.running) < 3:
            tree.start(rng.choice(prompts) + [rng.randint(0, 50) for _ in range(rng.randint(3, 30))])
        elif tree.running:
            req = rng.choice(tree.running)
            tree.slide(req, rng.randint(0, max(0, len(req.tokens) - WINDOW)))
            if rng.random() < 0.6:
                tree.finish(req)
        if rng.random() < 0.3:
            _evict_all_compressed(tree)
        tree.check_ledger()
        tree.check_running_reads()


def test_only_the_sink_of_a_long_cached_node_is_pinned() -> None:
    """A cached prompt stored whole: a request on it protects its sink and its window, not
    the compressed KV between them, which stays evictable as outside any window."""
    tree = Tree()
    prompt = list(range(3000, 3080))
    _play(tree, prompt, evicted=0)
    req = tree.start(prompt + [5, 6])
    assert req is not None and req.prefix == len(prompt)
    book = radix.ledger(tree.cache)["compressed"]
    assert book["protected"] <= SINK + 2 * RECENT, book
    _evict_all_compressed(tree)
    tree.check_ledger()
    tree.check_running_reads()
    assert tree.match(prompt[:SINK] + [9])[0] == SINK  # the sink is still there to reuse


def _checkpoint(tree: Tree, req: Running, upto: int) -> None:
    """A chunk boundary: the scheduler inserts what the request computed so far, adopts the
    tree's slots for it, and moves its lock to the new node."""
    params = InsertParams(key=_key(req.tokens[:upto]), value=req.row[:upto].clone(),
                          prev_prefix_len=req.prefix)
    params.set_evicted_seqlen(SWA, req.evicted)
    node = tree.cache.insert(params).last_device_node
    slots = tree.cache.path_device_indices(node)
    assert len(slots) == upto, (len(slots), upto)
    req.row[req.prefix:upto] = slots[req.prefix:upto]
    tree.cache.unlock(req.lock)
    req.lock = tree.cache.lock(node)
    req.prefix = upto


def _retract(tree: Tree, req: Running) -> None:
    """SGLang's retraction: the request's own slots back (compressed ones where alive), the
    lock released, nothing inserted."""
    dead_hi = max(req.evicted, req.prefix)
    lo = max(req.prefix, SINK)
    alive = [p for p in range(req.prefix, len(req.tokens)) if not (lo <= p < dead_hi)]
    dead = [p for p in range(req.prefix, len(req.tokens)) if lo <= p < dead_hi]
    if dead:
        tree.alloc.free_full_segments([(req.row[dead], dead[0])])
    if alive:
        tree.alloc.free(req.row[alive])
    tree.cache.unlock(req.lock)
    tree.running.remove(req)


@pytest.mark.parametrize("seed", range(6))
def test_chunked_requests_and_retraction_keep_every_read_alive(seed: int) -> None:
    rng = random.Random(200 + seed)
    tree = Tree()
    prompts = [[10_000 * (p + 1) + t for t in range(rng.randint(20, 60))] for p in range(3)]
    for _ in range(150):
        op = rng.random()
        if op < 0.35 and len(tree.running) < 3:
            tree.start(rng.choice(prompts) + [rng.randint(0, 50) for _ in range(rng.randint(3, 40))])
        elif op < 0.75 and tree.running:
            req = rng.choice(tree.running)
            upto = rng.randint(req.prefix, len(req.tokens))
            tree.slide(req, max(0, upto - WINDOW))
            if upto > req.prefix and rng.random() < 0.7:
                _checkpoint(tree, req, upto)
            elif rng.random() < 0.5:
                tree.finish(req)
        elif op < 0.85 and tree.running:
            _retract(tree, rng.choice(tree.running))
        else:
            _evict_all_compressed(tree)
        tree.check_ledger()
        tree.check_running_reads()


def test_a_short_last_chunk_locks_one_window_not_two() -> None:
    """Chunks of 40 then 6 tokens: the lock after the short one covers the window (and the
    sink), not all of the 40-token node before it."""
    tree = Tree()
    tokens = list(range(4000, 4046))
    req = tree.start(tokens)
    assert req is not None
    _checkpoint(tree, req, 40)
    tree.slide(req, 46 - WINDOW)
    _checkpoint(tree, req, 46)
    book = radix.ledger(tree.cache)["compressed"]
    assert book["protected"] <= SINK + WINDOW + 1, book
    assert radix.stats()["window_splits"] > 0
    tree.check_ledger()
    tree.check_running_reads()
