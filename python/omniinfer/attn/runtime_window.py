"""Serving-side arithmetic of OmniAttn: which KV positions a compressed layer keeps and frees.

The SGLang glue (``omniinfer.sglang_plugin.omni_attn``) does only tensor plumbing; every rule
about positions, windows, freed ranges and pool sizes lives here so that it can be tested
without SGLang. Positions are 0-based token positions of one sequence.

Conventions, matching :mod:`omniinfer.attn.masks` exactly: in a compressed layer the query at
position ``t`` reads keys ``[0, sink)`` and ``(t - recent, t]``, i.e. ``recent`` keys counting
itself. SGLang's sliding window ``W`` keeps keys ``[t - W, t]`` (``W + 1`` keys), so the window
handed to SGLang is ``recent - 1``; the sink is kept by SGLang's per-request eviction floor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KeySpan:
    """Keys one block of queries reads: ``[0, sink_end)`` and ``[recent_start, stop)``."""

    sink_end: int
    recent_start: int
    stop: int

    def positions(self) -> list[int]:
        return [*range(self.sink_end), *range(self.recent_start, self.stop)]

    @property
    def size(self) -> int:
        return self.sink_end + (self.stop - self.recent_start)


def sglang_window(recent: int) -> int:
    """The sliding window SGLang must be told so that it keeps ``recent`` keys per query."""
    if recent < 2:
        raise ValueError("recent must be >= 2: SGLang treats a window of 0 as no window")
    return recent - 1


def key_span(prefix_len: int, seq_len: int, sink: int, recent: int) -> KeySpan:
    """Keys read by the queries at positions ``[prefix_len, seq_len)`` (an extend or a decode).

    The first query ``prefix_len`` is the one that reaches furthest back: it needs
    ``(prefix_len - recent, ...]``; everything from there to ``seq_len`` is read by someone.
    """
    if not 0 <= prefix_len < seq_len:
        raise ValueError(f"need 0 <= prefix_len < seq_len, got {prefix_len}, {seq_len}")
    sink_end = min(sink, seq_len)
    recent_start = max(sink_end, prefix_len - recent + 1)
    return KeySpan(sink_end, recent_start, seq_len)


def kept_positions(seq_len: int, sink: int, recent: int) -> list[int]:
    """Keys the decode query at ``seq_len - 1`` reads: the evaluator's mask row, as indices."""
    return key_span(seq_len - 1, seq_len, sink, recent).positions()


def freeable_range(
    pre_len: int, sink: int, recent: int, cursor: int, interval: int = 1
) -> tuple[int, int]:
    """Positions ``[lo, hi)`` whose compressed-layer slots may be returned now.

    ``pre_len`` is the position of the next query (tokens already in the cache); ``cursor``
    is where the previous frees stopped. Mirrors SGLang's ``free_swa_out_of_window_slots``
    for page size 1 without prefix sharing, with the floor at ``sink``: nothing below the
    sink, nothing the query at ``pre_len`` still reads, and only once ``interval`` tokens
    are due. Returns an empty range (lo == hi) when nothing is freed.
    """
    window = sglang_window(recent)
    lo = max(cursor, sink)
    if pre_len - window < cursor + interval:
        return lo, lo
    hi = max(lo, pre_len - window)
    return lo, hi


def simulate_decode(
    prompt_len: int, new_tokens: int, sink: int, recent: int, interval: int = 1
) -> tuple[list[int], int]:
    """Live positions of one request after prefill plus ``new_tokens`` decode steps.

    Replays the order SGLang uses (free before each decode forward, then allocate the new
    token) and returns the live positions and the number freed; tests check that every
    query's keys stay live and that the live set converges to sink + recent.
    """
    live = set(range(prompt_len))
    cursor, freed = 0, 0
    for step in range(new_tokens):
        position = prompt_len + step
        lo, hi = freeable_range(position, sink, recent, cursor, interval)
        if hi > lo:
            for p in range(lo, hi):
                live.discard(p)
            freed += hi - lo
            cursor = hi
        needed = set(kept_positions(position + 1, sink, recent)) - {position}
        missing = needed - live
        if missing:
            raise AssertionError(f"query {position} lost keys {sorted(missing)[:5]}")
        live.add(position)
    return sorted(live), freed


def hybrid_layer_pattern(num_layers: int, compressed: Sequence[int]) -> list[int]:
    """SGLang's ``hybrid_layer_pattern``: 1 for a window (compressed) layer, 0 for full."""
    chosen = set(compressed)
    return [1 if i in chosen else 0 for i in range(num_layers)]


def model_overrides(
    num_layers: int, compressed: Sequence[int], recent: int
) -> dict[str, object]:
    """The ``--json-model-override-args`` entries that make SGLang build the hybrid pool."""
    return {
        "is_hybrid_swa": True,
        "hybrid_layer_pattern": hybrid_layer_pattern(num_layers, compressed),
        "sliding_window": sglang_window(recent),
    }


@dataclass(frozen=True)
class PoolSplit:
    """Token capacities of the two sub-pools for one KV byte budget."""

    full_tokens: int
    swa_tokens: int


def equal_bytes_split(
    max_total_tokens: int, num_layers: int, num_compressed: int, swa_tokens: int
) -> PoolSplit:
    """Pool sizes that spend what ``max_total_tokens`` tokens cost in an uncompressed model.

    Layers are assumed equally wide (Llama/Qwen style), so bytes reduce to layer-tokens:
    ``full * (L - C) + swa * C == max_total_tokens * L``. The compressed pool keeps the
    requested ``swa_tokens``; the rest goes to full layers.
    """
    if not 0 < num_compressed < num_layers:
        raise ValueError("need at least one compressed and one full layer")
    budget = max_total_tokens * num_layers - swa_tokens * num_compressed
    full = budget // (num_layers - num_compressed)
    if full <= 0:
        raise ValueError(f"a compressed pool of {swa_tokens} tokens leaves nothing for full layers")
    return PoolSplit(full, swa_tokens)


def ratio_split(
    max_total_tokens: int, num_layers: int, num_compressed: int, ratio: float
) -> PoolSplit:
    """As :func:`equal_bytes_split` with ``swa_tokens = ratio * full_tokens``."""
    if not 0 < ratio <= 1:
        raise ValueError("ratio must be in (0, 1]")
    full = int(max_total_tokens * num_layers / (num_layers - num_compressed + ratio * num_compressed))
    return PoolSplit(full, int(full * ratio))


EVICTION_INTERVAL = 16  # tokens a request may run past its window before its slots are freed
DEFAULT_CONTEXT = 2048  # request length the default pool split is balanced for
PREFILL_HEADROOM = 1.25  # compressed-pool share kept for prompts still being prefilled


def default_swa_ratio(sink: int, recent: int, interval: int = EVICTION_INTERVAL,
                      context: int = DEFAULT_CONTEXT) -> float:
    """Compressed-pool tokens per full-pool token when the operator sets no ratio.

    A decoding request of ``context`` tokens holds ``context`` full slots and at most
    ``sink + recent + interval`` compressed ones; the headroom lets prefills (which hold a
    whole chunk until the first free) proceed while the pools are balanced.
    """
    share = (sink + recent + interval) / context * PREFILL_HEADROOM
    return round(min(1.0, max(0.01, share)), 4)


def request_kv_tokens(context: int, sink: int, recent: int, interval: int) -> tuple[int, int]:
    """(full-layer, compressed-layer) slots one request of ``context`` tokens holds at most
    while decoding: all tokens, versus sink + recent plus what waits for the next free."""
    return context, min(context, sink + recent + interval)


def admissible(
    split: PoolSplit, context: int, sink: int, recent: int, interval: int, prefill_chunk: int
) -> int:
    """How many requests of ``context`` tokens fit at once, one prefill chunk in flight."""
    full_need, swa_need = request_kv_tokens(context, sink, recent, interval)
    by_full = split.full_tokens // full_need
    by_swa = max(0, split.swa_tokens - min(prefill_chunk, context)) // swa_need
    return min(by_full, by_swa)


def balanced_swa_ratio(
    max_total_tokens: int,
    num_layers: int,
    num_compressed: int,
    sink: int,
    recent: int,
    *,
    context: int = DEFAULT_CONTEXT,
    interval: int = EVICTION_INTERVAL,
    prefill_chunk: int | None = None,
) -> float:
    """The compressed/full ratio that admits the most ``context``-token requests in this budget.

    With the budget known, no fixed headroom is needed: the full pool gets exactly ``N`` whole
    requests, ``N`` being the most for which the compressed pool still holds ``N`` windows plus
    one prefill chunk, and every remaining byte goes to the compressed pool. That pool is the
    one shorter requests exhaust first (below the window they hold as many compressed slots as
    full ones), so the slack is most useful there.
    """
    total = max_total_tokens * num_layers
    full_layers = num_layers - num_compressed
    full_need, swa_need = request_kv_tokens(context, sink, recent, interval)
    chunk = min(prefill_chunk or context, context)
    most = (total - chunk * num_compressed) // (full_need * full_layers + swa_need * num_compressed)
    for n in range(int(most), 0, -1):
        exact = (total / (n * full_need) - full_layers) / num_compressed
        ratio = min(1.0, int(exact * 10_000) / 10_000)  # 4 decimals, rounded towards more full
        if ratio <= 0:
            continue
        split = ratio_split(max_total_tokens, num_layers, num_compressed, ratio)
        if admissible(split, context, sink, recent, interval, chunk) >= n:
            return ratio
    return default_swa_ratio(sink, recent, interval, context)


def shared_prefix_swa_ratio(
    prefixes: int,
    prefix_len: int,
    requests: int,
    own_tokens: int,
    sink: int,
    recent: int,
    interval: int = EVICTION_INTERVAL,
) -> float:
    """Compressed/full ratio for shared-prefix traffic served with the radix cache.

    The tree keeps each of ``prefixes`` shared prefixes once: ``prefix_len`` full slots, but
    only its sink and window (``sink + recent - 1``) compressed ones; each of ``requests``
    running requests adds ``own_tokens`` full slots (question plus output) and at most
    ``sink + recent + interval`` compressed ones. The ratio makes both pools fill together.
    """
    if min(prefixes, prefix_len, requests, own_tokens) <= 0:
        raise ValueError("need positive prefixes, prefix_len, requests and own_tokens")
    full = prefixes * prefix_len + requests * own_tokens
    swa = prefixes * min(prefix_len, sink + sglang_window(recent)) + requests * min(
        own_tokens, sink + recent + interval)
    return round(min(1.0, swa / full), 4)


def transfer_sink_span(prefix_len: int, seq_len: int, window_size: int, sink: int,
                       page_size: int) -> tuple[int, int]:
    """Positions ``[lo, hi)`` of a compressed layer's sink that a PD transfer must add to
    SGLang's window pages.

    SGLang sends an SWA layer's pages from ``floor_page(max(prefix_len, seq_len - window))``
    to ``seq_len`` (``window`` is SGLang's, :func:`sglang_window`); the sink is the first
    ``sink`` tokens, whole pages. What lies below the window and inside the (page-rounded)
    sink, and past what the decode side already holds (``prefix_len``, page-aligned), is
    added; nothing when the window already covers the sink. Both sides compute the same span,
    so their page lists stay the same length and match position by position.
    """
    if page_size < 1:
        raise ValueError("page_size must be >= 1")
    window_start = max(prefix_len, seq_len - window_size) // page_size * page_size
    sink_end = -(-sink // page_size) * page_size
    hi = min(sink_end, window_start, seq_len)
    return (prefix_len, hi) if hi > prefix_len else (prefix_len, prefix_len)
