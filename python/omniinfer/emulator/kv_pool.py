"""KV accounting of one emulated worker: the token pool, the radix cache inside it, admission.

The pool holds the radix cache's tokens plus each admitted request's *private* tokens (the part
not yet inserted into the cache). A request's prompt moves into the cache, locked, when its
prefill completes; the whole sequence is inserted when it finishes. Admission follows SGLang:
a request gets in only when the pool, after evicting unlocked cache, can hold its uncached
prompt plus ``new_token_ratio`` of its remaining output on top of what the running requests
have reserved.

With an attention pattern (``sparse.AttnPattern``, compressed share ``c``, window ``w = sink +
recent``) the pool is counted in all-layer tokens: every token held (privately or in the cache)
costs ``1 - c`` for the full layers, and each admitted request adds ``c·min(L, w)`` for its
compressed layers, ``L`` the tokens it holds (:attr:`EmuRequest._kv_len`). Cached prefixes keep
full layers only (ASSUMPTION: as SGLang's SWA cache tombstones a prefix's sliding-window KV); a
request reusing one is charged its own compressed window, and no recompute time for it. Without
a pattern every figure is the plain token count, in integers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from omniinfer.emulator.radix_cache import RadixCache
from omniinfer.emulator.request import EmuRequest
from omniinfer.emulator.sparse import AttnPattern

EPSILON = 1e-6  # rounding slack of the fractional (pattern) accounting


class KVPool:
    """Token slots: free, held by the radix cache (evictable unless locked), or private."""

    def __init__(self, capacity: int, tree: RadixCache | None, new_token_ratio: float,
                 reserve_output: bool, pattern: AttnPattern | None = None) -> None:
        self.capacity = capacity
        self.tree = tree
        self.new_token_ratio = new_token_ratio
        self.reserve_output = reserve_output  # a prefill worker never decodes: nothing to reserve
        self.private_tokens = 0
        self.pattern = pattern or AttnPattern()
        self.window_tokens = 0  # Σ over holding requests of their compressed-layer tokens
        self._eps = EPSILON if self.pattern.active else 0

    def _units(self, tokens: float, window: int) -> float:
        """Pool room of ``tokens`` held in every layer plus ``window`` in the compressed ones."""
        if not self.pattern.active:
            return tokens
        c = self.pattern.compressed_fraction
        return (1.0 - c) * tokens + c * window

    def _grow(self, held: int, extra: int) -> int:
        """Compressed-layer tokens a request holding ``held`` tokens adds with ``extra`` more."""
        return self.pattern.window_tokens(held + extra) - self.pattern.window_tokens(held)

    def _used_units(self) -> float:
        return self._units(self.private_tokens + (self.tree.total if self.tree else 0), self.window_tokens)

    def used(self) -> int:
        """Slots in use (all-layer tokens, rounded up under a pattern)."""
        used = self._used_units()
        return used if isinstance(used, int) else math.ceil(used - EPSILON)

    def evictable(self) -> float:
        return self._units(self.tree.evictable if self.tree else 0, 0)

    def available(self) -> float:
        """Free now plus what eviction could free."""
        return self.capacity - self._used_units() + self.evictable()

    def footprint(self, tokens: int) -> float:
        """Pool room a lone sequence of ``tokens`` tokens needs."""
        return self.pattern.kv_tokens(tokens)

    def match(self, ids: Sequence[int]) -> tuple[int, object]:
        """The cached prefix of ``ids``: its length and the node that ends it (None: no cache)."""
        if self.tree is None:
            return 0, None
        return self.tree.match_prefix(ids)

    def output_reserve(self, request: EmuRequest) -> int:
        if not self.reserve_output:
            return 0
        remaining = max(request.max_new_tokens - len(request.output_ids), 0)
        return int(remaining * self.new_token_ratio)

    def _reserve_units(self, request: EmuRequest, held: int) -> float:
        reserve = self.output_reserve(request)
        return self._units(reserve, self._grow(held, reserve))

    def reserved_for(self, requests: Iterable[EmuRequest]) -> float:
        """Room the admitted ``requests`` keep for their remaining output."""
        return sum(self._reserve_units(r, r._kv_len) for r in requests)

    def admission_need(self, request: EmuRequest, uncached: int, prefix: int) -> float:
        """Room admitting ``request`` takes: its ``uncached`` prompt tokens after a cached
        ``prefix`` plus its output reserve (SGLang's rule; compressed windows under a pattern)."""
        held = max(request._kv_len, prefix)
        return (self._units(uncached, self._grow(request._kv_len, held + uncached - request._kv_len))
                + self._reserve_units(request, held + uncached))

    def lock(self, request: EmuRequest, node: object) -> None:
        """Protect the prefix ``node`` ends from eviction while ``request`` uses it."""
        if node is not None and self.tree is not None:
            self.tree.lock(node)
            request._node = node

    def unlock(self, request: EmuRequest) -> None:
        if request._node is not None and self.tree is not None:
            self.tree.unlock(request._node)
        request._node = None

    def allocate(self, request: EmuRequest, tokens: int, prefix: int = 0) -> bool:
        """Give ``request`` ``tokens`` private slots (after a cached ``prefix`` it holds),
        evicting unlocked cache if needed."""
        held = max(request._kv_len, prefix)
        grow = self._grow(request._kv_len, held + tokens - request._kv_len)
        need = self._units(tokens, grow)
        free = self.capacity - self._used_units()
        if free < need - self._eps and self.tree is not None:
            self.tree.evict(self._tokens_for(need - free))
            free = self.capacity - self._used_units()
        if free < need - self._eps:
            return False
        request._private += tokens
        self.private_tokens += tokens
        request._kv_len = held + tokens
        self.window_tokens += grow
        return True

    def _tokens_for(self, units: float) -> int:
        """Cached tokens to evict to free ``units`` of room."""
        if not self.pattern.active:
            return int(units)
        full = 1.0 - self.pattern.compressed_fraction
        return math.ceil(units / full - EPSILON) if full > 0 else 0

    def cache_prompt(self, request: EmuRequest) -> None:
        """After its prefill: the prompt's KV moves into the cache, locked for the request."""
        if self.tree is None:
            return
        self.tree.insert(request._fill_ids)
        _, node = self.tree.match_prefix(request._fill_ids)
        self.tree.lock(node)
        self.unlock(request)
        request._node = node
        moved = min(request._private, len(request._fill_ids))
        request._private -= moved
        self.private_tokens -= moved

    def free(self, request: EmuRequest, cache_full_sequence: bool) -> None:
        """Give back the request's slots; what it computed stays in the cache (unlocked)."""
        if self.tree is not None and request._prefilled and not request.error:
            ids = request.input_ids
            if cache_full_sequence:  # the last token's KV was never computed
                ids = ids + request.output_ids[:-1]
            self.tree.insert(ids)  # adds at most the request's private tokens: the pool cannot grow
        self.unlock(request)
        self.private_tokens -= request._private
        request._private = 0
        self.window_tokens -= self.pattern.window_tokens(request._kv_len)
        request._kv_len = 0

    def flush(self) -> None:
        if self.tree is not None:
            self.tree.reset()
