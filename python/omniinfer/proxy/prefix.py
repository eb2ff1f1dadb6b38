"""Automatic prefix cache (APC) matching: chained hashes of fixed-size token blocks per worker.

The hash of block i covers block i *and* everything before it, so one hash names a whole prefix
path — a set of such hashes per worker is an approximate radix tree of what that worker has
cached. Only full blocks are hashed (a partial tail block is never reused by a paged cache).
Each worker's set is an LRU bounded in blocks, standing in for the worker's own eviction —
unless the worker's KV events drive it (``cache_truth.py``), which insert and remove exactly
what the worker stores and evicts.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

ROOT_HASH = 0x9E3779B97F4A7C15  # the chain's start: the "hash" of the empty prefix


def chain_hash(previous: int, block: Sequence[int]) -> int:
    """The hash of the prefix ending with ``block``, given the hash of the prefix before it."""
    return hash((previous, tuple(block)))


def block_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of the full ``block_size`` blocks of ``tokens`` (deterministic ints)."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    hashes: list[int] = []
    previous = ROOT_HASH
    for start in range(0, len(tokens) - block_size + 1, block_size):
        previous = chain_hash(previous, tokens[start:start + block_size])
        hashes.append(previous)
    return hashes


class PrefixIndex:
    """Which worker (by key) holds which prefix blocks; longest-prefix match per worker."""

    def __init__(self, max_blocks_per_worker: int = 1 << 20) -> None:
        self.max_blocks = max(1, max_blocks_per_worker)
        self._blocks: dict[str, OrderedDict[int, None]] = {}
        self._owners: dict[int, set[str]] = {}

    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        """Number of leading blocks of ``hashes`` each worker holds (workers with 0 omitted)."""
        matched: dict[str, int] = {}
        if not hashes:
            return matched
        alive = self._owners.get(hashes[0])
        if not alive:
            return matched
        alive = set(alive)
        for depth, h in enumerate(hashes[1:], start=1):
            owners = self._owners.get(h)
            still = alive & owners if owners else set()
            for gone in alive - still:
                matched[gone] = depth
            alive = still
            if not alive:
                break
        for key in alive:
            matched[key] = len(hashes)
        return matched

    def insert(self, key: str, hashes: Sequence[int]) -> None:
        """Record that ``key`` now caches this prefix (touching it as most recently used)."""
        blocks = self._blocks.setdefault(key, OrderedDict())
        for h in hashes:
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
                self._owners.setdefault(h, set()).add(key)
        while len(blocks) > self.max_blocks:
            old, _ = blocks.popitem(last=False)
            self._disown(old, key)

    def remove(self, key: str, hashes: Sequence[int]) -> None:
        """``key`` no longer holds these blocks (the worker evicted them)."""
        blocks = self._blocks.get(key)
        if not blocks:
            return
        for h in hashes:
            if h in blocks:
                del blocks[h]
                self._disown(h, key)

    def holds(self, key: str, h: int) -> bool:
        blocks = self._blocks.get(key)
        return blocks is not None and h in blocks

    def size(self, key: str) -> int:
        blocks = self._blocks.get(key)
        return len(blocks) if blocks else 0

    def clear(self, key: str) -> None:
        for h in self._blocks.pop(key, {}):
            self._disown(h, key)

    def clear_all(self) -> None:
        self._blocks.clear()
        self._owners.clear()

    def _disown(self, h: int, key: str) -> None:
        owners = self._owners.get(h)
        if owners is not None:
            owners.discard(key)
            if not owners:
                del self._owners[h]
