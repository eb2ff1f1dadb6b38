"""``oas``: one cost model instead of thresholds, with deferred submission and resorting.

Prefill: each request's best instance is the one with the lowest predicted TTFT = predicted
queue time + batch time of its *uncached* tokens (the APC match) + KV transfer, from a batch time
model each instance learns online from its own measured batches (``oas_cost``); exact ties are
broken at random. Requests wait in the proxy, short-and-old first, and go to their instance just
before its next predicted batch boundary; none waits more than one predicted cycle plus a bound
(``deferral``). Decode: longest first to the least-loaded decode instance under its cap.

The ablations are the same policy with one part switched off, registered beside it:
``oas_no_defer`` (released at once to the best instance), ``oas_no_resort`` (arrival order),
``oas_no_cache`` (the estimate ignores the cache), ``oas_no_lpt`` (decode in arrival order).
"""

from __future__ import annotations

from typing import Any, ClassVar

from omniinfer.proxy.base import RouteRequest, register_policy
from omniinfer.proxy.deferral import DeferralOptions, DeferredQueue, Instance, Waiting, get_order
from omniinfer.proxy.oas_cost import InstanceClock, TransferModel, predicted_ttft
from omniinfer.proxy.policies._deferred import DeferringPolicy
from omniinfer.proxy.workers import Worker


@register_policy("oas")
class OASPolicy(DeferringPolicy):
    order_name: ClassVar[str] = "short_old_first"
    defer: ClassVar[bool] = True
    use_cache: ClassVar[bool] = True
    transfer = TransferModel()  # the same for every prefill instance of one decode pool

    def make_queue(self) -> DeferredQueue:
        config = self.context.config
        options = DeferralOptions(
            lead_fraction=float(getattr(config, "oas_lead_fraction", 1.0)),
            bound_cycles=float(getattr(config, "oas_hold_bound_cycles", 8.0)))
        gate = None if self.defer else (lambda inst, now: True)
        return DeferredQueue(get_order(self.order_name), self.estimate, options, self.rng, gate)

    def work_seconds(self, request: RouteRequest, worker: Worker) -> float:
        tokens = request.uncached_tokens(worker) if self.use_cache else request.prompt_tokens
        return self.clock(worker).model.predict([max(1, tokens)])

    def estimate(self, item: Waiting, inst: Instance, now: float) -> Any:
        worker = self.allowed(item, inst)
        if worker is None:
            return None
        request: RouteRequest = item.payload.request
        assert isinstance(inst, InstanceClock)
        return predicted_ttft(inst, request.uncached_tokens(worker), request.prompt_tokens, now,
                              self.transfer, self.use_cache)


@register_policy("oas_no_defer")
class OASNoDefer(OASPolicy):
    defer = False


@register_policy("oas_no_resort")
class OASNoResort(OASPolicy):
    order_name = "fifo"


@register_policy("oas_no_cache")
class OASNoCache(OASPolicy):
    use_cache = False


@register_policy("oas_no_lpt")
class OASNoLPT(OASPolicy):
    lpt = False
