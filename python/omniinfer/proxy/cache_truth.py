"""Cache truth from KV events: a worker's stored and evicted pages → the router's block hashes.

The router matches prompts by chained hashes of ``block_size`` tokens (``prefix.py``). A worker's
events name its own pages instead: opaque hashes of ``page_size`` tokens, each stored with its
tokens and its parent page's hash. ``PageChain`` knows, per worker page, where the page ends on
the router's block grid — the router hash of the last full router block before its end and the
tokens after that block (fewer than ``block_size``), worked out from the page's stored run when
a child names it — so a child page's router blocks follow from its parent alone, whatever the
two sizes (SGLang on CPU pages by 1 token, the router by 16). A
router block belongs to the page holding its last token: stored with it, removed with it.
``WorkerCacheTruth`` sums the pages of all of a worker's publishers (one per DP rank) into a
reference count per router block and keeps the worker's ``PrefixIndex`` entry equal to the
blocks with a count above zero. ``SequenceCheck`` classifies sequence numbers (in order, gap,
restart). All pure: the sockets are in ``kv_subscriber.py``.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Iterable, Sequence
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


class _Run:
    """The pages of one ``BlockStored`` event on the router's grid.

    ``hashes`` are the router blocks that end inside the run (over ``tail`` + ``tokens``); a
    page's own place — the router hash before its end and the tokens after it — is worked out
    only when a later event names it as parent. So storing a run costs one chained hash per
    router block and no Python work per page (SGLang on CPU and the emulator page by 1 token).
    """

    __slots__ = ("previous", "tail", "tokens", "page", "pages", "hashes")

    def __init__(self, previous: int, tail: tuple[int, ...], tokens: tuple[int, ...],
                 page: int, pages: tuple[int, ...], block_size: int) -> None:
        self.previous, self.tail, self.tokens, self.page, self.pages = (
            previous, tail, tokens, page, pages)
        buffer = tail + tokens
        hashes: list[int] = []
        for start in range(0, len(buffer) - block_size + 1, block_size):
            previous = chain_hash(previous, buffer[start:start + block_size])
            hashes.append(previous)
        self.hashes = hashes

    def ends(self, block_size: int) -> dict[int, tuple[int, ...]]:
        """Page hash -> the router blocks whose last token is in that page (pages with any)."""
        first = block_size - 1 - len(self.tail)  # block 0's last token in ``tokens``
        owners = [self.pages[last // self.page]
                  for last in range(first, first + len(self.hashes) * block_size, block_size)]
        if self.page <= block_size:  # one block per page at most
            return dict(zip(owners, zip(self.hashes, strict=True), strict=True))
        out: dict[int, tuple[int, ...]] = {}
        for owner, h in zip(owners, self.hashes, strict=True):
            out[owner] = out.get(owner, ()) + (h,)
        return out

    def place(self, page_hash: int, block_size: int) -> tuple[int, tuple[int, ...]]:
        """(router hash of the last full block before the page's end, tokens after it)."""
        i = self.pages.index(page_hash)  # a scan in C, done once per child event
        end = len(self.tail) + min((i + 1) * self.page, len(self.tokens))
        full = end // block_size
        previous = self.hashes[full - 1] if full else self.previous
        cut = full * block_size
        if cut >= len(self.tail):
            return previous, self.tokens[cut - len(self.tail):end - len(self.tail)]
        return previous, (self.tail + self.tokens)[cut:end]


class PageChain:
    """One publisher's pages, each mapped onto the router's block grid."""

    def __init__(self, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self._pages: dict[int, _Run] = {}  # page hash -> the run it was stored in
        self._ends: dict[int, tuple[int, ...]] = {}  # page hash -> router blocks ending in it
        self.stats = ChainStats()

    def __len__(self) -> int:
        return len(self._pages)

    def store(self, event: Stored) -> list[int]:
        """Router blocks the worker now holds because of ``event``."""
        if event.namespaced or event.medium not in GPU_MEDIA:
            self.stats.ignored_events += 1
            return []
        count, page, tokens = len(event.hashes), event.block_size, event.tokens
        if count == 0 or not (count - 1) * page < len(tokens) <= count * page:
            self.stats.malformed_events += 1
            return []
        if event.parent is None:
            previous, tail = ROOT_HASH, _EMPTY
        else:
            parent = self._pages.get(event.parent)
            if parent is None:
                self.stats.orphan_pages += count
                return []
            previous, tail = parent.place(event.parent, self.block_size)
        run = _Run(previous, tail, tokens, page, event.hashes, self.block_size)
        ends = run.ends(self.block_size)
        # Known pages (a replay, a repeated store) must not count twice. A page id names its
        # whole token path, so a known page maps to the same place from either run; only the
        # pages that end router blocks (and the first, where a replay starts) need the check.
        if event.hashes[0] in self._pages or not self._ends.keys().isdisjoint(ends):
            return self._store_known(event, previous, tail)
        return self._add(run, ends)

    def _add(self, run: _Run, ends: dict[int, tuple[int, ...]] | None = None) -> list[int]:
        self._pages.update(zip(run.pages, itertools.repeat(run)))
        self._ends.update(run.ends(self.block_size) if ends is None else ends)
        self.stats.stored_pages += len(run.pages)
        return list(run.hashes)

    def _store_known(self, event: Stored, previous: int, tail: tuple[int, ...]) -> list[int]:
        """Some pages are stored again (a replay, a repeated store): already counted, so only
        the new ones after them add blocks; each new stretch becomes its own run."""
        added: list[int] = []
        page, size, hashes = event.block_size, self.block_size, event.hashes
        i = 0
        while i < len(hashes):
            known = self._pages.get(hashes[i])
            if known is not None:
                previous, tail = known.place(hashes[i], size)
                i += 1
                continue
            j = i
            while j < len(hashes) and hashes[j] not in self._pages:
                j += 1
            run = _Run(previous, tail, event.tokens[i * page:j * page], page, hashes[i:j], size)
            added.extend(self._add(run))
            previous, tail = run.place(hashes[j - 1], size)
            i = j
        return added

    def remove(self, event: Removed) -> list[int]:
        """Router blocks the worker no longer holds because of ``event``."""
        if event.medium not in GPU_MEDIA:
            self.stats.ignored_events += 1
            return []
        unknown = list(map(self._pages.pop, event.hashes, itertools.repeat(None))).count(None)
        self.stats.unknown_removals += unknown
        self.stats.removed_pages += len(event.hashes) - unknown
        ends = map(self._ends.pop, event.hashes, itertools.repeat(None))
        return [h for blocks in ends if blocks for h in blocks]

    def clear(self) -> list[int]:
        """Forget every page; the router blocks they held."""
        released = [h for blocks in self._ends.values() for h in blocks]
        self._pages.clear()
        self._ends.clear()
        return released


class WorkerCacheTruth:
    """One worker's cache as router blocks: the union of its publishers' pages → its index."""

    def __init__(self, key: str, index: PrefixIndex, block_size: int, sources: int = 1,
                 max_pages: int = 1 << 22, pending_s: float = 30.0) -> None:
        self.key = key
        self.max_pages = max_pages  # per publisher; beyond it that publisher's view is reset
        self.overflows = 0
        self.index = index
        self.chains = [PageChain(block_size) for _ in range(max(1, sources))]
        self._counts: dict[int, int] = {}
        # Sent but not yet reported: a prompt's blocks count as held from the moment the router
        # sends it until the worker's events store them (its prefill is done) or ``pending_s``
        # passes, so the requests routed meanwhile see the prefix where it is being computed.
        self.pending_s = pending_s
        self._pending: dict[int, float] = {}  # router block -> deadline
        self._deadlines: collections.deque[tuple[float, list[int]]] = collections.deque()
        self.expired = 0
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
        """Forget what ``source`` (or every source) said: after a gap, a restart, a re-admission
        (every source: what was sent and not yet reported is forgotten too)."""
        self.resets += 1
        if source is None:
            self.expire(float("inf"))
        for i, chain in enumerate(self.chains):
            if source is None or i == source:
                self._release(chain.clear())

    def expect(self, hashes: Sequence[int], now: float) -> None:
        """The router sent a prompt of these blocks here (see ``_pending``)."""
        self.expire(now)
        if not hashes:
            return
        deadline = now + self.pending_s
        new = [h for h in hashes if h not in self._counts]
        if new:
            self._pending.update(dict.fromkeys(new, deadline))
            self._deadlines.append((deadline, new))
        self.index.insert(self.key, hashes)  # also refreshes the index's LRU order

    def expire(self, now: float) -> None:
        """Drop the sent blocks the worker has not reported by their deadline."""
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, hashes = self._deadlines.popleft()
            late = [h for h in hashes if self._pending.get(h) == deadline]  # not sent again
            for h in late:
                del self._pending[h]
            stale = [h for h in late if h not in self._counts]
            if stale:
                self.expired += len(stale)
                self.index.remove(self.key, stale)

    def _hold(self, hashes: Iterable[int]) -> None:
        hashes = list(hashes)
        for h in hashes:
            self._counts[h] = self._counts.get(h, 0) + 1
        if self._pending:
            for h in hashes:
                self._pending.pop(h, None)  # reported: the events own it from now on
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
                "pending_blocks": len(self._pending), "expired_pending_blocks": self.expired,
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
