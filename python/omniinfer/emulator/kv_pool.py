"""KV accounting of one emulated worker: the token pool, the radix cache inside it, admission.

The pool holds the radix cache's tokens plus each admitted request's *private* tokens (the part
not yet inserted into the cache). A request's prompt moves into the cache, locked, when its
prefill completes; the whole sequence is inserted when it finishes. Admission follows SGLang:
a request gets in only when the pool, after evicting unlocked cache, can hold its uncached
prompt plus ``new_token_ratio`` of its remaining output on top of what the running requests
have reserved.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from omniinfer.emulator.radix_cache import RadixCache
from omniinfer.emulator.request import EmuRequest


class KVPool:
    """Token slots: free, held by the radix cache (evictable unless locked), or private."""

    def __init__(self, capacity: int, tree: RadixCache | None, new_token_ratio: float,
                 reserve_output: bool) -> None:
        self.capacity = capacity
        self.tree = tree
        self.new_token_ratio = new_token_ratio
        self.reserve_output = reserve_output  # a prefill worker never decodes: nothing to reserve
        self.private_tokens = 0

    def used(self) -> int:
        return self.private_tokens + (self.tree.total if self.tree else 0)

    def evictable(self) -> int:
        return self.tree.evictable if self.tree else 0

    def available(self) -> int:
        """Free now plus what eviction could free."""
        return self.capacity - self.used() + self.evictable()

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

    def reserved_for(self, requests: Iterable[EmuRequest]) -> int:
        return sum(self.output_reserve(r) for r in requests)

    def lock(self, request: EmuRequest, node: object) -> None:
        """Protect the prefix ``node`` ends from eviction while ``request`` uses it."""
        if node is not None and self.tree is not None:
            self.tree.lock(node)
            request._node = node

    def unlock(self, request: EmuRequest) -> None:
        if request._node is not None and self.tree is not None:
            self.tree.unlock(request._node)
        request._node = None

    def allocate(self, request: EmuRequest, tokens: int) -> bool:
        """Give ``request`` ``tokens`` private slots, evicting unlocked cache if needed."""
        free = self.capacity - self.used()
        if free < tokens and self.tree is not None:
            self.tree.evict(tokens - free)
            free = self.capacity - self.used()
        if free < tokens:
            return False
        request._private += tokens
        self.private_tokens += tokens
        return True

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

    def flush(self) -> None:
        if self.tree is not None:
            self.tree.reset()
