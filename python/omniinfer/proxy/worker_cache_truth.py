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
restart). All pure: the sockets are in ``cache_truth.py``.

Bounds, since a worker's events are not trusted: a page longer than ``max_page_tokens`` is
refused (counted in ``oversized_events``); a worker's publishers together keep at most
``max_tokens`` tokens of stored runs (past it the oldest stores are forgotten first, counted in
``evicted_pages``) and each at most ``max_pages`` pages (past it that publisher's view is
reset). Storing one event costs time linear in its tokens and pages, whatever the page size.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Iterable, Sequence
from typing import Any

from omniinfer.kv_event_wire import GPU_MEDIA, Batch, Cleared, Removed, Stored
from omniinfer.proxy.prefix import ROOT_HASH, PrefixIndex, chain_hash

_EMPTY: tuple[int, ...] = ()
DEFAULT_MAX_TOKENS = 1 << 24  # per worker, as --max-tree-size's default
DEFAULT_MAX_PAGE_TOKENS = 1 << 14  # SGLang pages hold 1..256 tokens in practice
RUN_CHARGE = 2  # a stored run's own records cost about two 1-token pages' (~300 B)
_STAMPS = itertools.count()  # the order runs were stored in, over every chain


@dataclasses.dataclass
class ChainStats:
    stored_pages: int = 0
    removed_pages: int = 0
    orphan_pages: int = 0  # stored under a parent page never seen (missed events): dropped
    unknown_removals: int = 0  # removal of a page never seen
    ignored_events: int = 0  # other media (host/disk tiers), LoRA / salted namespaces
    malformed_events: int = 0
    oversized_events: int = 0  # pages longer than max_page_tokens: refused
    evicted_pages: int = 0  # forgotten, oldest first, to keep the worker within max_tokens


class _Run:
    """The pages of one ``BlockStored`` event on the router's grid.

    ``hashes`` are the router blocks that end inside the run (over ``tail`` + ``tokens``); a
    page's own place — the router hash before its end and the tokens after it — is worked out
    only when a later event names it as parent. So storing a run costs one chained hash per
    router block and no Python work per page (SGLang on CPU and the emulator page by 1 token).
    ``live`` counts the chain's pages that still map to this run; ``stamp`` orders runs by
    age (for the token budget).
    """

    __slots__ = ("previous", "tail", "tokens", "page", "pages", "hashes", "live", "stamp",
                 "charge", "_positions")

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
        self.live = 0
        self.stamp = next(_STAMPS)
        # what the run costs the token budget: its tokens, plus a run's own records (about
        # what RUN_CHARGE tokens cost), so that many tiny stores cannot outgrow the budget
        self.charge = len(tokens) + RUN_CHARGE
        self._positions: dict[int, int] | None = None

    def ends(self, block_size: int) -> dict[int, tuple[int, ...]]:
        """Page hash -> the router blocks whose last token is in that page (pages with any)."""
        first = block_size - 1 - len(self.tail)  # block 0's last token in ``tokens``
        owners = [self.pages[last // self.page]
                  for last in range(first, first + len(self.hashes) * block_size, block_size)]
        if self.page <= block_size:  # one block per page at most
            return dict(zip(owners, zip(self.hashes, strict=True), strict=True))
        lists: dict[int, list[int]] = {}  # built once: growing tuples is quadratic in a page
        for owner, h in zip(owners, self.hashes, strict=True):
            found = lists.get(owner)
            if found is None:
                lists[owner] = [h]
            else:
                found.append(h)
        return {owner: tuple(blocks) for owner, blocks in lists.items()}

    def position(self, page_hash: int) -> int:
        """The index of ``page_hash`` (its first occurrence) in ``pages``: a scan for a short
        run, a map made once for a long one (else naming a parent late in a long run is
        linear per child event)."""
        if len(self.pages) <= 32:
            return self.pages.index(page_hash)
        if self._positions is None:
            count = len(self.pages)
            self._positions = dict(zip(reversed(self.pages), range(count - 1, -1, -1),
                                       strict=True))
        return self._positions[page_hash]

    def place(self, page_hash: int, block_size: int) -> tuple[int, tuple[int, ...]]:
        """(router hash of the last full block before the page's end, tokens after it)."""
        i = self.position(page_hash)
        end = len(self.tail) + min((i + 1) * self.page, len(self.tokens))
        full = end // block_size
        previous = self.hashes[full - 1] if full else self.previous
        cut = full * block_size
        if cut >= len(self.tail):
            return previous, self.tokens[cut - len(self.tail):end - len(self.tail)]
        return previous, (self.tail + self.tokens)[cut:end]


class PageChain:
    """One publisher's pages, each mapped onto the router's block grid.

    ``tokens`` counts the tokens of the stored runs some page still maps to (what the chain
    holds), each run charged ``RUN_CHARGE`` more for its own records; ``len`` counts pages."""

    def __init__(self, block_size: int, max_page_tokens: int = DEFAULT_MAX_PAGE_TOKENS) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.max_page_tokens = max_page_tokens
        self._pages: dict[int, _Run] = {}  # page hash -> the run it was stored in
        self._ends: dict[int, tuple[int, ...]] = {}  # page hash -> router blocks ending in it
        self._runs: collections.OrderedDict[_Run, None] = collections.OrderedDict()  # oldest 1st
        self.tokens = 0
        self.stats = ChainStats()

    def __len__(self) -> int:
        return len(self._pages)

    def store(self, event: Stored) -> list[int]:
        """Router blocks the worker now holds because of ``event``."""
        if event.namespaced or event.medium not in GPU_MEDIA:
            self.stats.ignored_events += 1
            return []
        count, page, tokens = len(event.hashes), event.block_size, event.tokens
        if page > self.max_page_tokens:
            self.stats.oversized_events += 1
            return []
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
        if self._pages.keys().isdisjoint(run.pages):  # the usual case: no Python per page
            before = len(self._pages)
            self._pages.update(zip(run.pages, itertools.repeat(run)))
            run.live = len(self._pages) - before  # distinct pages
        else:  # pages taken over from older runs: those hold one page fewer each
            for h in dict.fromkeys(run.pages):
                old = self._pages.get(h)
                if old is not None:
                    self._drop(old)
                self._pages[h] = run
                run.live += 1
        self._ends.update(run.ends(self.block_size) if ends is None else ends)
        self._runs[run] = None
        self.tokens += run.charge
        self.stats.stored_pages += len(run.pages)
        return list(run.hashes)

    def _drop(self, run: _Run, pages: int = 1) -> None:
        """``pages`` pages of ``run`` are gone; the run (and its tokens) goes with its last."""
        run.live -= pages
        if run.live <= 0 and self._runs.pop(run, False) is None:
            self.tokens -= run.charge

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
        runs = collections.Counter(map(self._pages.pop, event.hashes, itertools.repeat(None)))
        unknown = runs.pop(None, 0)
        for run, pages in runs.items():  # counted in C: a Python step per run, not per page
            self._drop(run, pages)
        self.stats.unknown_removals += unknown
        self.stats.removed_pages += len(event.hashes) - unknown
        ends = map(self._ends.pop, event.hashes, itertools.repeat(None))
        return [h for blocks in ends if blocks for h in blocks]

    def oldest(self) -> int | None:
        """The stamp of the oldest run still held (None when empty)."""
        return next(iter(self._runs)).stamp if self._runs else None

    def evict_oldest(self) -> list[int]:
        """Forget the oldest run still held (its pages that still map to it); the router
        blocks they held."""
        run, _ = self._runs.popitem(last=False)
        self.tokens -= run.charge
        released: list[int] = []
        for h in run.pages:
            if self._pages.get(h) is run:
                del self._pages[h]
                self.stats.evicted_pages += 1
                released.extend(self._ends.pop(h, ()))
        run.live = 0
        return released

    def clear(self) -> list[int]:
        """Forget every page; the router blocks they held."""
        released = [h for blocks in self._ends.values() for h in blocks]
        self._pages.clear()
        self._ends.clear()
        self._runs.clear()
        self.tokens = 0
        return released


class WorkerCacheTruth:
    """One worker's cache as router blocks: the union of its publishers' pages → its index."""

    def __init__(self, key: str, index: PrefixIndex, block_size: int, sources: int = 1,
                 max_pages: int = 1 << 22, pending_s: float = 30.0, *,
                 max_tokens: int = DEFAULT_MAX_TOKENS,
                 max_page_tokens: int = DEFAULT_MAX_PAGE_TOKENS) -> None:
        self.key = key
        self.max_pages = max_pages  # per publisher; beyond it that publisher's view is reset
        self.max_tokens = max_tokens  # over all publishers; beyond it the oldest go first
        self.overflows = 0
        self.index = index
        self.chains = [PageChain(block_size, max_page_tokens) for _ in range(max(1, sources))]
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

    def apply(self, source: int, batch: Batch, first_part: bool = True) -> None:
        """Apply one decoded batch of publisher ``source`` in order (or one slice of a large
        batch: only its first counts as a batch)."""
        self.batches += first_part
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
        if self.tokens() > self.max_tokens:
            self._evict()

    def tokens(self) -> int:
        """Tokens of the stored runs the worker's publishers still hold pages of."""
        return sum(chain.tokens for chain in self.chains)

    def _evict(self) -> None:
        """Forget the oldest stores, over all publishers, until within ``max_tokens``."""
        total = self.tokens()
        while total > self.max_tokens:
            held = [(c.oldest(), i) for i, c in enumerate(self.chains) if c.oldest() is not None]
            if not held:
                return
            chain = self.chains[min(held)[1]]
            before = chain.tokens
            self._release(chain.evict_oldest())
            total -= before - chain.tokens

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
                "worker_tokens": self.tokens(),
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
