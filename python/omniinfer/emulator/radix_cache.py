"""A radix tree over token ids with lock counts and least-recently-used eviction.

Each node holds a run of token ids. ``match_prefix`` returns the longest resident prefix (splitting
a node where the match ends inside it, as SGLang's radix cache does); running requests ``lock``
the path they use; ``evict`` drops unlocked leaves, oldest access first, until enough tokens are
freed. With ``capacity`` set, ``insert`` evicts to stay within it. With a KV-event recorder
attached (``attach_events``), new nodes, evicted nodes and resets are reported as SGLang's
radix cache reports them (``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``); each node
then keeps the hash of its last token so that its children can name their parent block.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from omniinfer.emulator.interfaces import BasePrefixCache, CacheSize, MatchResult

if TYPE_CHECKING:
    from omniinfer.emulator.kv_event_publisher import KvEventRecorder


class _Node:
    __slots__ = ("key", "children", "parent", "lock_ref", "last_access", "last_hash")

    def __init__(self, key: tuple[int, ...], parent: _Node | None) -> None:
        self.key = key
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0
        self.last_hash: int | None = None  # KV events only: the block hash of the last token


def _common_length(a: tuple[int, ...], b: Sequence[int], start: int) -> int:
    n = min(len(a), len(b) - start)
    if tuple(b[start : start + n]) == a[:n]:
        return n
    i = 0
    while i < n and a[i] == b[start + i]:
        i += 1
    return i


class RadixCache(BasePrefixCache):
    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity
        self._clock = itertools.count(1)
        self.events: KvEventRecorder | None = None
        self.reset()

    def attach_events(self, recorder: KvEventRecorder) -> None:
        """Report changes to ``recorder`` from now on (attach while the cache is empty)."""
        self.events = recorder

    def _hash_of(self, node: _Node) -> int | None:
        return None if node is self.root else node.last_hash

    def reset(self) -> None:
        if self.events is not None:
            self.events.cleared()
        self.root = _Node((), None)
        self.root.lock_ref = 1  # never evicted
        self.total = 0
        self.evictable = 0

    # -- lookup -------------------------------------------------------------------------------
    def match_prefix(self, ids: Sequence[int]) -> MatchResult:
        node, pos, now = self.root, 0, next(self._clock)
        node.last_access = now
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                break
            n = _common_length(child.key, ids, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            node, pos = child, pos + n
            if n == 0:
                break
        return MatchResult(pos, node)

    def _split(self, child: _Node, n: int) -> _Node:
        """Cut ``child`` after its first ``n`` tokens; returns the new upper node."""
        parent = child.parent
        assert parent is not None
        upper = _Node(child.key[:n], parent)
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        if self.events is not None:
            upper.last_hash = self.events.last_hash(self._hash_of(parent), upper.key)
        parent.children[upper.key[0]] = upper
        child.key = child.key[n:]
        child.parent = upper
        upper.children[child.key[0]] = child
        return upper

    # -- insertion ----------------------------------------------------------------------------
    def insert(self, ids: Sequence[int]) -> int:
        match = self.match_prefix(ids)
        node, pos = match.node, match.length
        assert isinstance(node, _Node)
        if pos >= len(ids):
            return 0
        leaf = _Node(tuple(ids[pos:]), node)
        leaf.last_access = next(self._clock)
        node.children[leaf.key[0]] = leaf
        if self.events is not None:
            leaf.last_hash = self.events.stored(self._hash_of(node), leaf.key)
        added = len(leaf.key)
        self.total += added
        self.evictable += added
        if self.capacity is not None and self.total > self.capacity:
            self.lock(leaf)  # never evict what was just inserted to make room for itself
            self.evict(self.total - self.capacity)
            self.unlock(leaf)
        return added

    # -- locks --------------------------------------------------------------------------------
    def lock(self, node: object) -> None:
        assert isinstance(node, _Node)
        cur: _Node | None = node
        while cur is not None and cur is not self.root:
            if cur.lock_ref == 0:
                self.evictable -= len(cur.key)
            cur.lock_ref += 1
            cur = cur.parent

    def unlock(self, node: object) -> None:
        assert isinstance(node, _Node)
        cur: _Node | None = node
        now = next(self._clock)
        while cur is not None and cur is not self.root:
            cur.lock_ref -= 1
            assert cur.lock_ref >= 0, "unlock without lock"
            if cur.lock_ref == 0:
                self.evictable += len(cur.key)
            cur.last_access = now
            cur = cur.parent

    # -- eviction -----------------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        if num_tokens <= 0:
            return 0
        heap = [(n.last_access, id(n), n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_tokens:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            if self.events is not None:
                self.events.removed(self._hash_of(parent), node.key)
            del parent.children[node.key[0]]
            freed += len(node.key)
            self.total -= len(node.key)
            self.evictable -= len(node.key)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def _leaves(self) -> list[_Node]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root:
                out.append(node)
        return out

    def size(self) -> CacheSize:
        return CacheSize(self.total, self.evictable)
