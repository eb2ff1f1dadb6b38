"""``oas``: one cost model instead of thresholds, with deferred submission and resorting.

Prefill: each request's best instance is the one with the lowest predicted TTFT = predicted
queue time + batch time of its *uncached* tokens (the prefix-cache match) + KV transfer, from the
batch-time model each instance learns online from its own measured batches (``cost``); exact
ties are broken at random. Requests wait in the router and go to their instance just before
its next predicted batch boundary. The order adapts to the load (``load_adaptive``, with
``--oas-ttft-slo-secs``): short and old first while the waiting work drains within half the
objective, shortest first from then until the queue is calm again (a twentieth), and in both
those that can still meet the objective before those that no longer can; without an objective,
short and old first. None waits more than one predicted cycle plus ``--oas-hold-bound-cycles``
(32) cycles (``deferred_queue``). ``oas_aged`` is the former order: short and old first always, bound 8.

The release is work-conserving: an instance is *short of work*, whatever the model predicts,
while less than two batches of tokens sent to it are not back, or when its own load report shows
nothing waiting (one batch of credit); it is then open, and a request whose best instance is
busy goes to the best instance short of work instead of waiting. A model that thinks an
instance busy therefore cannot leave it idle while requests wait here.

Where prefixes are shared, a cache miss costs the cluster its recompute, not only the request's
TTFT: the estimate adds the compute an instance needs beyond the request's best-cached one
(``miss_weight``), and a request moves to an instance short of work only once it has waited as
long as that extra compute (``patient_redirect``, the ski-rental rule), and takes only the
capacity left once every request that prefers that instance has been served there. In regular
mode a streamed request's prefill ends at its first event, so the instance's clock closes it
there.
Decode: longest first to the least-loaded decode instance under its cap.

The ablations are the same policy with one part switched off, registered beside it:
``oas_no_defer`` (released at once to the best instance), ``oas_no_resort`` (arrival order),
``oas_no_cache`` (the estimate ignores the cache), ``oas_no_lpt`` (decode in arrival order),
``oas_jit_only`` (the prediction alone opens an instance: no work conservation),
``oas_no_slo`` (ignores ``--oas-ttft-slo-secs``), ``oas_ttft_only`` (no miss weight, no
patient redirect). Variants: ``oas_sjf`` orders by predicted compute alone (no aging; the hold
bound protects long requests); ``oas_mh`` gives up, by the Moore–Hodgson rule, the longest
requests that would make others miss the objective; ``oas_goodput`` is ``oas_sjf`` with a hold
bound of 32 cycles instead of 8 (SLO goodput under overload at the cost of the tail);
``oas_edf`` serves the requests that can still meet the objective oldest first (earliest
deadline), judging "can still" with the soonest instance's predicted queue included;
``oas_edf_obs`` (and ``oas_obs``, the shipped order) judge "can still" with the *measured* delay
instead: a high quantile of what recent requests spent between release and the end of their
prefill beyond their own predicted compute (``cost.ObservedDelay``); ``oas_edf_q1`` is
``oas_edf`` with one batch, not two, queued at an instance (lateness decided in the router's
queue rather than in the instances'); ``oas_q15`` is ``oas`` with one and a half batches
sent and not back, not two (half a batch queued behind the running one); ``oas_lq`` is
``oas`` judging "late" with the soonest instance's predicted queue included; ``oas_sticky``
charges a cache miss twice and waits twice the recompute before redirecting (chats kept on
the worker that holds them). What each part measured:
docs/benchmarks.md, "OmniProxy OAS evaluation" and "OmniProxy SLO capacity".
"""

from __future__ import annotations

from typing import Any, ClassVar

from omniinfer.proxy.oas.cost import InstanceClock, TransferModel, predicted_ttft
from omniinfer.proxy.oas.deferred_policy import DeferringPolicy
from omniinfer.proxy.oas.deferred_queue import (
    DeferralOptions,
    DeferredQueue,
    Instance,
    Waiting,
    get_order,
    load_adaptive,
    slo_first,
    slo_sacrifice,
)
from omniinfer.proxy.policy_api import RouteRequest, register_policy
from omniinfer.proxy.workers import Role, Worker


@register_policy("oas")
class OASPolicy(DeferringPolicy):
    order_name: ClassVar[str] = "load_adaptive"
    defer: ClassVar[bool] = True
    use_cache: ClassVar[bool] = True
    work_conserving: ClassVar[bool] = True  # a reported-empty instance is open (one batch)
    slo_aware: ClassVar[bool] = True  # honour --oas-ttft-slo-secs when given
    queue_batches: ClassVar[float] = 2.0  # an instance is short of work below this many batches
    slo_rule: ClassVar[str] = "first"  # "first": slo_first; "sacrifice": Moore–Hodgson
    late_with_queue: ClassVar[bool] = False  # "late" counts the soonest instance's queue
    bound_cycles: ClassVar[float | None] = None  # None: --oas-hold-bound-cycles' value (32)
    adaptive_threshold: ClassVar[float] = 0.5  # load_adaptive: drain time / objective
    adaptive_calm: ClassVar[float | None] = 0.05  # load_adaptive: back to aging below this
    # A cache miss costs the cluster its recompute, not only this request's TTFT: the estimate
    # adds miss_weight x the compute this instance needs beyond the request's cheapest one.
    miss_weight: ClassVar[float] = 1.0
    patient_redirect: ClassVar[bool] = True  # to a starved instance only after the ski-rental wait
    redirect_weight: ClassVar[float] = 1.0  # that wait as a multiple of the extra compute
    transfer = TransferModel()  # the same for every prefill instance of one decode pool

    def make_queue(self) -> DeferredQueue:
        config = self.context.config
        options = DeferralOptions(
            lead_fraction=config.oas_lead_fraction,
            bound_cycles=(self.bound_cycles if self.bound_cycles is not None
                          else config.oas_hold_bound_cycles))
        gate = None if self.defer else (lambda inst, now: True)
        starved = self._starved if self.work_conserving else None
        slo = config.oas_ttft_slo_secs if self.slo_aware else None
        if self.order_name != "load_adaptive":
            order = get_order(self.order_name)
        elif slo:  # the load is judged against the objective: without one, aging alone
            order = load_adaptive(float(slo), self._capacity, self.adaptive_threshold,
                                  self.adaptive_calm)
        else:
            order = get_order("short_old_first")
        if slo and self.slo_rule == "sacrifice":
            order = slo_sacrifice(float(slo), self._capacity)
        elif slo:
            ahead = (self._observed_delay if self.late_observed
                     else self._soonest_start if self.late_with_queue else None)
            order = slo_first(order, float(slo), ahead)
        redirect = self._redirect_wait if self.use_cache and self.patient_redirect else None
        return DeferredQueue(order, self.estimate, options, self.rng, gate, starved=starved,
                             redirect_wait=redirect)

    @staticmethod
    def _extra_compute(item: Waiting, clock: InstanceClock, uncached: int) -> float:
        """Seconds this instance would spend on the prompt tokens it lacks but another allowed
        worker has cached (by this instance's own batch time model)."""
        floor = item.payload.min_uncached
        if uncached <= floor:
            return 0.0
        return max(0.0, clock.model.predict([uncached]) - clock.model.predict([max(1, floor)]))

    def _redirect_wait(self, item: Waiting, inst: Instance) -> float:
        placed = self.placement(item, inst)
        if placed is None:
            return 0.0
        request, worker, clock = placed
        return self.redirect_weight * self._extra_compute(item, clock,
                                                          request.uncached_tokens(worker))

    def _capacity(self, now: float) -> tuple[int, float]:
        """Prefill instances and the mean predicted seconds already sent to each."""
        clocks = list(self.clocks.values())
        if not clocks:
            return 1, 0.0
        return len(clocks), sum(c.queue_seconds(now) for c in clocks) / len(clocks)

    def _soonest_start(self, now: float) -> float:
        """Predicted seconds until the least-backlogged prefill instance could start a request."""
        return min((c.queue_seconds(now) for c in self.clocks.values()), default=0.0)

    def _observed_delay(self, now: float) -> float:
        """What recent requests spent between release and the end of their prefill beyond
        their own predicted compute (a high quantile, ``ObservedDelay``)."""
        assert self.delays is not None  # late_observed makes it
        return self.delays.value()

    def _starved(self, inst: Instance, now: float) -> bool:
        """Would run short of work: reported empty, or less than ``queue_batches`` batches of
        tokens sent and not back (the batch running and the next one).

        The second test needs no timing, so a prediction inflated by a loaded host's delays
        cannot keep an instance idle while requests wait here.
        """
        assert isinstance(inst, InstanceClock)
        config = self.context.config
        batch = max(inst.batch_tokens or 0.0, config.oas_batch_tokens)
        depth = self.queue_batches * batch
        return inst.starved() or inst.backlog_tokens() < depth

    def on_loads(self, worker: Worker) -> None:
        """Learn the worker's own queue; a reported-empty instance may take work at once."""
        super().on_loads(worker)
        if self.context.role is Role.DECODE or not self.work_conserving:
            return
        self.clock(worker).on_report(worker.loads.waiting_reqs)
        if self.queue.items:
            self._pump()

    def work_seconds(self, request: RouteRequest, worker: Worker) -> float:
        tokens = request.uncached_tokens(worker) if self.use_cache else request.prompt_tokens
        return self.clock(worker).model.predict([max(1, tokens)])

    def estimate(self, item: Waiting, inst: Instance, now: float) -> Any:
        placed = self.placement(item, inst)
        if placed is None:
            return None
        request, worker, clock = placed
        uncached = request.uncached_tokens(worker)
        ttft = predicted_ttft(clock, uncached, request.prompt_tokens, now, self.transfer,
                              self.use_cache)
        if self.use_cache and self.miss_weight:
            ttft += self.miss_weight * self._extra_compute(item, clock, uncached)
        return ttft


def _variant(name: str, **switches: Any) -> type[OASPolicy]:
    """Register ``oas`` with some class-level switches changed (an ablation or a variant)."""
    unknown = sorted(set(switches) - set(dir(OASPolicy)))
    if unknown:
        raise TypeError(f"{name}: OASPolicy has no switch {', '.join(unknown)}")
    return register_policy(name)(type(f"OAS_{name}", (OASPolicy,), switches))


OASNoDefer = _variant("oas_no_defer", defer=False)
OASNoResort = _variant("oas_no_resort", order_name="fifo")
OASNoCache = _variant("oas_no_cache", use_cache=False)
OASNoLPT = _variant("oas_no_lpt", lpt=False)
OASShortestFirst = _variant("oas_sjf", order_name="shortest_first")
OASNoSLO = _variant("oas_no_slo", slo_aware=False)
OASJitOnly = _variant("oas_jit_only", work_conserving=False)
OASMooreHodgson = _variant("oas_mh", slo_rule="sacrifice")
OASGoodput = _variant("oas_goodput", order_name="shortest_first", bound_cycles=32.0)
OASTTFTOnly = _variant("oas_ttft_only", miss_weight=0.0, patient_redirect=False)
OASAged = _variant("oas_aged", order_name="short_old_first", bound_cycles=8.0)
OASSticky = _variant("oas_sticky", miss_weight=2.0, redirect_weight=2.0)
OASEDF = _variant("oas_edf", order_name="fifo", late_with_queue=True)
OASEDFObserved = _variant("oas_edf_obs", order_name="fifo", late_observed=True)
OASObserved = _variant("oas_obs", late_observed=True)
OASEDFOneBatch = _variant("oas_edf_q1", order_name="fifo", late_with_queue=True,
                          queue_batches=1.0)
OASHalfBatchQueued = _variant("oas_q15", queue_batches=1.5)
OASLateWithQueue = _variant("oas_lq", late_with_queue=True)
