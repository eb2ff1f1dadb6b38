"""Reusable scorers (each returns a score in [0, 1] per worker URL, higher is better)."""

from __future__ import annotations

from omniinfer.proxy.base import RouteRequest, Scorer
from omniinfer.proxy.workers import Worker


class PrefixAffinity(Scorer):
    """Share of the prompt already in the worker's cache (by the router's APC index)."""

    category = "affinity"

    def __call__(self, request: RouteRequest, workers: list[Worker]) -> dict[str, float]:
        total = max(1, request.prompt_tokens)
        return {w.url: request.cached_tokens(w) / total for w in workers}


class TokenLoad(Scorer):
    """Fewer in-flight tokens is better: 1 - load / max load."""

    category = "distribution"

    def __call__(self, request: RouteRequest, workers: list[Worker]) -> dict[str, float]:
        top = max((w.load_tokens() for w in workers), default=0)
        if top <= 0:
            return {w.url: 1.0 for w in workers}
        return {w.url: 1.0 - w.load_tokens() / top for w in workers}


class KVHeadroom(Scorer):
    """Free KV cache as the worker reports it (/v1/loads token_usage)."""

    category = "balance"

    def __call__(self, request: RouteRequest, workers: list[Worker]) -> dict[str, float]:
        return {w.url: max(0.0, 1.0 - w.loads.token_usage) for w in workers}


def least_loaded(workers: list[Worker]) -> Worker:
    """Fewest in-flight tokens, then fewest in-flight requests, then list order."""
    return min(workers, key=lambda w: (w.load_tokens(), w.inflight_requests))
