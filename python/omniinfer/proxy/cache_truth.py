"""Cache truth from KV events: a worker's stored and evicted pages → the router's block hashes.

The router matches prompts by chained hashes of ``block_size`` tokens (``prefix.py``). A worker's
events name its own pages instead: opaque hashes of ``page_size`` tokens, each stored with its
tokens and its parent page's hash. ``PageChain`` keeps, per worker page, where the page ends on
the router's block grid — the router hash of the last full router block before its end and the
tokens after that block (fewer than ``block_size``) — so a child page's router blocks follow from
its parent alone, whatever the two sizes (SGLang on CPU pages by 1 token, the router by 16). A
router block belongs to the page holding its last token: stored with it, removed with it.
``WorkerCacheTruth`` sums the pages of all of a worker's publishers (one per DP rank) into a
reference count per router block and keeps the worker's ``PrefixIndex`` entry equal to the
blocks with a count above zero. ``SequenceCheck`` classifies sequence numbers (in order, gap,
restart). All pure: the sockets are in ``kv_subscriber.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from omniinfer.kv_events import GPU_MEDIA, Batch, Cleared, Removed, Stored
from omniinfer.proxy.prefix import ROOT_HASH, PrefixIndex, chain_hash

_EMPTY: tuple[int, ...] = ()


@dataclasses.dataclass
class ChainStats:
    stored_pages: int = 0
    removed_pages: int = 0
    orphan_pages: int = 0  # stored under a parent page never seen (missed events): dropped
    unknown_removals: int = 0  # removal of a page never seen
    ignored_events: int = 0  # other media (host/disk tiers), LoRA / salted namespaces
    malformed_events: int = 0


class PageChain:
    """One publisher's pages, each mapped onto the router's block grid."""

    def __init__(self, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        # page hash -> (router hash before the tail, tail tokens, router blocks ending here)
        self._pages: dict[int, tuple[int, tuple[int, ...], tuple[int, ...]]] = {}
        self.stats = ChainStats()

    def __len__(self) -> int:
        return len(self._pages)

    def store(self, event: Stored) -> list[int]:
        """Router blocks the worker now holds because of ``event``."""
        if event.namespaced or event.medium not in GPU_MEDIA:
            self.stats.ignored_events += 1
            return []
        pages = _split_pages(event)
        if pages is None:
            self.stats.malformed_events += 1
            return []
        if event.parent is None:
            previous, tail = ROOT_HASH, _EMPTY
        else:
            parent = self._pages.get(event.parent)
            if parent is None:
                self.stats.orphan_pages += len(pages)
                return []
            previous, tail = parent[0], parent[1]
        size = self.block_size
        added: list[int] = []
        for page_hash, tokens in pages:
            known = self._pages.get(page_hash)
            if known is not None:  # stored again (a replay or a repeated store): already counted
                previous, tail = known[0], known[1]
                continue
            buffer = tail + tokens
            full = len(buffer) - len(buffer) % size
            ending: list[int] = []
            for start in range(0, full, size):
                previous = chain_hash(previous, buffer[start:start + size])
                ending.append(previous)
            tail = buffer[full:]
            self._pages[page_hash] = (previous, tail, tuple(ending) if ending else _EMPTY)
            self.stats.stored_pages += 1
            added.extend(ending)
        return added

    def remove(self, event: Removed) -> list[int]:
        """Router blocks the worker no longer holds because of ``event``."""
        if event.medium not in GPU_MEDIA:
            self.stats.ignored_events += 1
            return []
        released: list[int] = []
        for page_hash in event.hashes:
            page = self._pages.pop(page_hash, None)
            if page is None:
                self.stats.unknown_removals += 1
                continue
            self.stats.removed_pages += 1
            released.extend(page[2])
        return released

    def clear(self) -> list[int]:
        """Forget every page; the router blocks they held."""
        released = [h for page in self._pages.values() for h in page[2]]
        self._pages.clear()
        return released


def _split_pages(event: Stored) -> list[tuple[int, tuple[int, ...]]] | None:
    """(page hash, page tokens) pairs; the last page may be short. None if sizes disagree."""
    count, size, tokens = len(event.hashes), event.block_size, event.tokens
    if count == 0 or not (count - 1) * size < len(tokens) <= count * size:
        return None
    return [(h, tokens[i * size:(i + 1) * size]) for i, h in enumerate(event.hashes)]


class WorkerCacheTruth:
    """One worker's cache as router blocks: the union of its publishers' pages → its index."""

    def __init__(self, key: str, index: PrefixIndex, block_size: int, sources: int = 1,
                 max_pages: int = 1 << 22) -> None:
        self.key = key
        self.max_pages = max_pages  # per publisher; beyond it that publisher's view is reset
        self.overflows = 0
        self.index = index
        self.chains = [PageChain(block_size) for _ in range(max(1, sources))]
        self._counts: dict[int, int] = {}
        self.batches = 0
        self.cleared = 0
        self.resets = 0

    def apply(self, source: int, batch: Batch) -> None:
        """Apply one decoded batch of publisher ``source`` in order."""
        self.batches += 1
        chain = self.chains[source]
        for event in batch.events:
            if isinstance(event, Stored):
                self._hold(chain.store(event))
            elif isinstance(event, Removed):
                self._release(chain.remove(event))
            elif isinstance(event, Cleared):
                self.cleared += 1
                self._release(chain.clear())
        if len(chain) > self.max_pages:  # a publisher that never evicts cannot grow us forever
            self.overflows += 1
            self.reset(source)

    def reset(self, source: int | None = None) -> None:
        """Forget what ``source`` (or every source) said: after a gap, a restart, a re-admission."""
        self.resets += 1
        for i, chain in enumerate(self.chains):
            if source is None or i == source:
                self._release(chain.clear())

    def _hold(self, hashes: Iterable[int]) -> None:
        hashes = list(hashes)
        for h in hashes:
            self._counts[h] = self._counts.get(h, 0) + 1
        if hashes:
            self.index.insert(self.key, hashes)  # also refreshes the index's LRU order

    def _release(self, hashes: Iterable[int]) -> None:
        gone = []
        for h in hashes:
            left = self._counts.get(h, 0) - 1
            if left > 0:
                self._counts[h] = left
            else:
                self._counts.pop(h, None)
                gone.append(h)
        if gone:
            self.index.remove(self.key, gone)

    def blocks(self) -> int:
        return len(self._counts)

    def describe(self) -> dict[str, Any]:
        stats = [dataclasses.asdict(c.stats) for c in self.chains]
        total = {k: sum(s[k] for s in stats) for k in stats[0]}
        return {"router_blocks": self.blocks(), "worker_pages": sum(len(c) for c in self.chains),
                "batches": self.batches, "cleared": self.cleared, "resets": self.resets,
                "overflows": self.overflows, **total}


class SequenceCheck:
    """Classifies one publisher's sequence numbers (0, 1, 2, ... from its start)."""

    def __init__(self) -> None:
        self.expected: int | None = None

    def classify(self, seq: int) -> str:
        """'first', 'ok', 'gap' (batches were lost) or 'restart' (the publisher began anew)."""
        if self.expected is None:
            return "first"
        if seq == self.expected:
            return "ok"
        return "gap" if seq > self.expected else "restart"

    def accept(self, seq: int) -> None:
        self.expected = seq + 1
