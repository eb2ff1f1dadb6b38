"""The prefix-reuse rules of OmniAttn with a radix cache, kept apart from SGLang's tree.

A cached prefix of length ``P`` is reusable by a new request only if every compressed-layer
key that request's queries read is still in the cache: the sink ``[0, min(sink, P))`` and the
last ``recent - 1`` positions ``[P - recent + 1, P)`` (the query at ``P`` reads ``recent``
keys counting itself, :mod:`omniinfer.attn.masks`). Positions in between may be gone.

The SGLang component (``omniinfer.sglang_plugin.omni_attn.radix``) keeps the sink by three
rules, each mirrored here so that it can be tested without SGLang:

- insert: the sink part of a new node is stored live even when the request's window had
  already moved past it (:func:`live_ranges`);
- evict: a node that holds a sink position never loses its compressed KV on its own, only
  together with its full KV when the whole node leaves the tree (:func:`holds_sink`);
- match: a boundary is accepted only where the sink and the window above it are alive
  (:class:`SinkWindowMatch`, equal to :func:`reusable` on every path).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def sink_end(sink: int, page_size: int = 1) -> int:
    """First position past the kept sink, rounded up to a page (SGLang frees whole pages)."""
    if sink < 0 or page_size < 1:
        raise ValueError(f"need sink >= 0 and page_size >= 1, got {sink}, {page_size}")
    return -(-sink // page_size) * page_size


def holds_sink(node_start: int, sink_stop: int) -> bool:
    """Whether a tree node starting at ``node_start`` holds some sink position."""
    return node_start < sink_stop


def live_ranges(start: int, end: int, evicted: int, sink_stop: int) -> list[tuple[int, int]]:
    """Positions of ``[start, end)`` whose compressed KV a new node keeps on insert.

    ``evicted`` is where the request's window eviction stopped: its compressed slots
    ``[sink, evicted)`` are freed, the sink and ``[evicted, end)`` are alive.
    """
    ranges = []
    sink_hi = min(end, sink_stop, evicted)
    if start < sink_hi:
        ranges.append((start, sink_hi))
    tail = max(start, evicted)
    if tail < end:
        if ranges and ranges[-1][1] >= tail:
            ranges[-1] = (ranges[-1][0], end)
        else:
            ranges.append((tail, end))
    return ranges


def reusable(alive: Sequence[bool], prefix_len: int, sink: int, recent: int) -> bool:
    """Reference rule: may a request reuse the first ``prefix_len`` cached positions?

    ``alive[p]`` tells whether position ``p`` still has compressed KV.
    """
    if prefix_len > len(alive):
        return False
    needed = [*range(min(sink, prefix_len)), *range(max(0, prefix_len - recent + 1), prefix_len)]
    return all(alive[p] for p in needed)


@dataclass
class SinkWindowMatch:
    """Incremental form of :func:`reusable` for a walk down a tree path, node by node.

    Nodes are all-or-nothing: each has a length and one alive flag. ``accept`` returns
    whether the path ending with this node is a reusable prefix. A dead node inside the
    sink ends every later acceptance; a dead node elsewhere needs ``window`` alive tokens
    after it.
    """

    sink_stop: int
    window: int
    depth: int = 0
    sink_ok: bool = True
    run: float = float("inf")  # alive tokens since the last dead node

    def accept(self, length: int, alive: bool) -> bool:
        start, self.depth = self.depth, self.depth + length
        if not alive:
            if holds_sink(start, self.sink_stop):
                self.sink_ok = False
            self.run = 0
            return False
        self.run += length
        return self.sink_ok and self.run >= self.window
