"""Automatic prefix cache (APC) matching: chained hashes of fixed-size token blocks per worker.

The hash of block i covers block i *and* everything before it, so one hash names a whole prefix
path — a set of such hashes per worker is an approximate radix tree of what that worker has
cached. Only full blocks are hashed (a partial tail block is never reused by a paged cache).
Each worker's set is an LRU bounded in blocks, standing in for the worker's own eviction —
unless the worker's KV events drive it (``worker_cache_truth.py``), which insert and remove exactly
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
    whole = tuple(tokens)  # its slices are the tuples the hash needs: no copy per block
    for start in range(0, len(whole) - block_size + 1, block_size):
        previous = chain_hash(previous, whole[start:start + block_size])
        hashes.append(previous)
    return hashes


class PrefixIndex:
    """Which worker (by key) holds which prefix blocks; longest-prefix match per worker.

    Each block's owners are one int, a bit per worker: half the memory of a set per block
    (about 190 bytes a block instead of 400, at up to ``max_blocks`` per worker) and a match
    that ANDs masks instead of copying sets. A worker's bit is freed when it is cleared.
    """

    def __init__(self, max_blocks_per_worker: int = 1 << 20) -> None:
        self.max_blocks = max(1, max_blocks_per_worker)
        self._blocks: dict[str, OrderedDict[int, None]] = {}
        self._owners: dict[int, int] = {}  # block hash -> mask of the workers' bits
        self._bits: dict[str, int] = {}  # worker key -> its bit
        self._keys: dict[int, str] = {}  # bit -> worker key

    def _bit(self, key: str) -> int:
        bit = self._bits.get(key)
        if bit is None:
            bit = 1
            while bit in self._keys:  # the lowest free bit: masks stay small ints
                bit <<= 1
            self._bits[key], self._keys[bit] = bit, key
        return bit

    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        """Number of leading blocks of ``hashes`` each worker holds (workers with 0 omitted)."""
        matched: dict[str, int] = {}
        if not hashes:
            return matched
        owners = self._owners
        alive = owners.get(hashes[0], 0)
        depth = 1
        for h in hashes[1:]:
            if not alive:
                break
            still = alive & owners.get(h, 0)
            if still != alive:
                self._settle(alive & ~still, depth, matched)
            alive = still
            depth += 1
        if alive:
            self._settle(alive, len(hashes), matched)
        return matched

    def _settle(self, mask: int, depth: int, matched: dict[str, int]) -> None:
        while mask:
            bit = mask & -mask  # the lowest set bit
            matched[self._keys[bit]] = depth
            mask ^= bit

    def insert(self, key: str, hashes: Sequence[int]) -> None:
        """Record that ``key`` now caches this prefix (touching it as most recently used)."""
        blocks = self._blocks.setdefault(key, OrderedDict())
        bit = self._bit(key)
        owners = self._owners
        for h in hashes:
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
                owners[h] = owners.get(h, 0) | bit
        while len(blocks) > self.max_blocks:
            old, _ = blocks.popitem(last=False)
            self._disown(old, bit)

    def remove(self, key: str, hashes: Sequence[int]) -> None:
        """``key`` no longer holds these blocks (the worker evicted them)."""
        blocks = self._blocks.get(key)
        if not blocks:
            return
        bit = self._bits[key]
        for h in hashes:
            if h in blocks:
                del blocks[h]
                self._disown(h, bit)

    def holds(self, key: str, h: int) -> bool:
        blocks = self._blocks.get(key)
        return blocks is not None and h in blocks

    def size(self, key: str) -> int:
        blocks = self._blocks.get(key)
        return len(blocks) if blocks else 0

    def keys(self) -> list[str]:
        """Workers with at least one block."""
        return [k for k, blocks in self._blocks.items() if blocks]

    def distinct(self) -> int:
        """Distinct blocks held by any worker."""
        return len(self._owners)

    def clear(self, key: str) -> None:
        blocks = self._blocks.pop(key, None)
        bit = self._bits.pop(key, None)
        if bit is None:
            return
        for h in blocks or ():
            self._disown(h, bit)
        del self._keys[bit]

    def _disown(self, h: int, bit: int) -> None:
        mask = self._owners.get(h)
        if mask is not None:
            mask &= ~bit
            if mask:
                self._owners[h] = mask
            else:
                del self._owners[h]
