"""``cache_aware``: the SGLang router's cache-aware semantics, decided in tokens.

1. Imbalance gate: if (max - min) load > abs threshold and max > min * rel threshold, send the
   request to the least-loaded worker (reason ``imbalance``). Load is in-flight tokens; the
   absolute threshold keeps the SGLang flag's unit — requests — and is converted to tokens with
   the running mean tokens per request.
2. Otherwise, if the best prefix match covers more than ``cache_threshold`` of the prompt, send it
   to that worker (``cache_hit``; ties go to the less loaded).
3. Otherwise send it to the worker whose index holds the fewest blocks — the most free cache
   (``cache_miss``); ties go to the less loaded.
The prefix index (the per-worker approximate tree) is maintained by the router for every policy.
"""

from __future__ import annotations

from omniinfer.proxy.policy_api import (
    Decision,
    Policy,
    RouteRequest,
    least_loaded,
    register_policy,
)
from omniinfer.proxy.workers import Worker


@register_policy("cache_aware")
class CacheAwarePolicy(Policy):
    uses_prefix = True

    def pick(self, request: RouteRequest, workers: list[Worker]) -> Decision:
        if len(workers) == 1:
            return Decision(workers[0], "only_candidate")
        config = self.context.config
        loads = [w.load_tokens() for w in workers]
        high, low = max(loads), min(loads)
        abs_tokens = config.balance_abs_threshold * self.context.mean_request_tokens
        if high - low > abs_tokens and high > low * config.balance_rel_threshold:
            return Decision(least_loaded(workers), "imbalance")
        best = max(workers, key=lambda w: (request.cached_tokens(w), -w.load_tokens()))
        cached = request.cached_tokens(best)
        if request.prompt_tokens > 0 and cached / request.prompt_tokens > config.cache_threshold:
            return Decision(best, "cache_hit")
        index = self.context.prefix_index
        smallest = min(workers, key=lambda w: (index.size(w.url), w.load_tokens()))
        return Decision(smallest, "cache_miss")
