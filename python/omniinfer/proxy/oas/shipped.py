"""``omni_default`` and ``omni_earliest_batch``: OAS as OmniInfer's own proxy ships it.

Both hold requests in the proxy while every prefill instance is overloaded (more than 32,000
tokens or 32 requests sent and not back), and release them in the shipped order
0.8·(Tmax−T)/Tmax + 0.2·W/Wmax (short and old first) to a non-overloaded instance:

* ``omni_default``: longest APC match, then fewest load tokens, then fewest running;
* ``omni_earliest_batch``: the earliest predicted finish — the instance's expected next batch
  start (last batch end + its average cycle) plus the mean measured duration of batches of the
  size it would then run (a per-batch-size ring of measurements).

There is no hold bound (OmniInfer's proxy has none). Decode: LPT to the least-loaded decode
instance.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

from omniinfer.proxy.oas.cost import InstanceClock
from omniinfer.proxy.oas.deferred_policy import DeferringPolicy
from omniinfer.proxy.oas.deferred_queue import (
    DeferralOptions,
    DeferredQueue,
    Instance,
    Waiting,
    get_order,
)
from omniinfer.proxy.policy_api import register_policy

MAX_BATCH_TOKENS = 32000  # OmniInfer's thresholds of an overloaded prefill instance
MAX_RUNNING = 32


def not_overloaded(inst: Instance, now: float) -> bool:
    assert isinstance(inst, InstanceClock)
    return inst.backlog_tokens() <= MAX_BATCH_TOKENS and len(inst.sent) < MAX_RUNNING


@register_policy("omni_default")
class OmniDefaultPolicy(DeferringPolicy):
    order_name: ClassVar[str] = "upstream_weights"

    def make_queue(self) -> DeferredQueue:
        options = DeferralOptions(bound_cycles=math.inf)
        return DeferredQueue(get_order(self.order_name), self.estimate, options, self.rng,
                             gate=not_overloaded, choose_among_open=True)

    def estimate(self, item: Waiting, inst: Instance, now: float) -> Any:
        placed = self.placement(item, inst)
        if placed is None:
            return None
        request, worker, clock = placed
        return (-request.cached_tokens(worker), clock.backlog_tokens(), len(clock.sent))


@register_policy("omni_earliest_batch")
class OmniEarliestBatchPolicy(OmniDefaultPolicy):
    def estimate(self, item: Waiting, inst: Instance, now: float) -> Any:
        placed = self.placement(item, inst)
        return None if placed is None else predicted_finish(placed[2], now)


def predicted_finish(inst: InstanceClock, now: float) -> float:
    """Expected next batch start plus the measured duration of a batch of that size."""
    size = len(inst.sent) + 1
    cycle = inst.cycle_seconds(0.0)
    start = now if inst.is_idle() or inst.last_end is None else max(now, inst.last_end + cycle)
    measured = inst.ring_seconds(size)
    return start + (measured if measured is not None else cycle)
