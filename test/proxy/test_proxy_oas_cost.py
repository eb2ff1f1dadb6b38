"""The OAS cost model: online batch-time learning, batch detection, queue and TTFT predictions."""

from __future__ import annotations

import asyncio
import random

import pytest

from omniinfer.proxy.config import RouterConfig
from omniinfer.proxy.oas.cost import (
    MIN_SEED_TOKENS,
    BatchTimeModel,
    InstanceClock,
    ObservedDelay,
    TransferModel,
    predicted_ttft,
)
from omniinfer.proxy.oas.deferred_queue import Waiting
from omniinfer.proxy.oas.policy import OASJitOnly, OASPolicy
from omniinfer.proxy.policy_api import PolicyContext, RouteRequest, create_policy
from omniinfer.proxy.prefix import PrefixIndex
from omniinfer.proxy.workers import Role, Worker


def truth(tokens: list[int]) -> float:
    """An H100-like prefill pass: 5 ms + 0.2 ms/request + 27 µs/token + attention."""
    return 0.005 + 0.0002 * len(tokens) + 27e-6 * sum(tokens) + 5e-10 * sum(t * t for t in tokens)


def test_model_learns_batch_time_from_measurements() -> None:
    rng = random.Random(0)
    model = BatchTimeModel()
    for _ in range(300):
        batch = [rng.randint(100, 6000) for _ in range(rng.randint(1, 6))]
        model.update(batch, truth(batch) * rng.uniform(0.97, 1.03))  # 3 % timing noise
    for batch in ([3500], [500, 500, 500], [8000], [2000, 6000]):
        assert model.predict(batch) == pytest.approx(truth(batch), rel=0.08)
    assert model.per_token() == pytest.approx(27e-6, rel=0.25)


def test_model_seed_only_before_measurements_and_never_negative() -> None:
    model = BatchTimeModel()
    model.seed_per_token(50e-6 * MIN_SEED_TOKENS, MIN_SEED_TOKENS)
    assert model.per_token() == pytest.approx(50e-6)
    assert model.predict([]) == 0.0
    model.update([1000], 0.02)
    model.seed_per_token(1.0 * MIN_SEED_TOKENS, MIN_SEED_TOKENS)  # ignored: a measurement exists
    assert model.per_token() < 1e-3
    model.update([1], -5.0)  # a nonsense duration is ignored
    assert model.samples == 1
    assert model.predict([1]) >= 0.0


def test_clock_groups_close_completions_into_one_batch() -> None:
    clock = InstanceClock("w", gap=0.020)
    for key, tokens in (("a", 1000), ("b", 2000), ("c", 3000)):
        clock.on_sent(key, tokens, 0.0)
    assert clock.on_done("a", 1.000) is None
    assert clock.on_done("b", 1.010) is None  # same batch (within 20 ms)
    clock.on_sent("d", 500, 1.005)
    closed = clock.on_done("c", 2.000)  # a new batch: closes the first
    assert closed is not None and sorted(closed.tokens) == [1000, 2000]
    assert closed.start == 0.0 and closed.end == pytest.approx(1.010)
    assert clock.model.samples == 1 and clock.cycle == pytest.approx(1.010)
    closed = clock.on_done("d", 2.500)
    assert closed is not None and closed.tokens == [3000]
    assert closed.start == pytest.approx(1.010)  # busy since the previous batch ended
    assert clock.by_size[1] and clock.ring_seconds(1) == pytest.approx(0.990)


def test_queue_drains_with_time_and_failures_release_work() -> None:
    clock = InstanceClock("w")
    assert clock.queue_seconds(0.0) == 0.0 and clock.is_idle()
    clock.on_sent("a", 4000, 0.0)
    clock.on_sent("b", 4000, 0.0)
    full = clock.queue_seconds(0.0)
    assert full == pytest.approx(clock.model.predict([4000, 4000]))
    assert clock.queue_seconds(full / 2) == pytest.approx(full / 2)
    assert clock.queue_seconds(full * 3) == 0.0
    clock.on_failed("a")
    clock.on_failed("b")
    assert clock.is_idle() and clock.backlog_tokens() == 0


def test_predicted_ttft_counts_only_uncached_tokens_and_transfer() -> None:
    busy, idle = InstanceClock("busy"), InstanceClock("idle")
    busy.on_sent("x", 8000, 0.0)
    transfer = TransferModel(latency_s=0.001, seconds_per_token=1e-6)
    cold = predicted_ttft(idle, 4000, 4000, 0.0, transfer)
    warm = predicted_ttft(idle, 200, 4000, 0.0, transfer)
    assert warm < cold
    assert predicted_ttft(idle, 200, 4000, 0.0, transfer, use_cache=False) == pytest.approx(cold)
    assert predicted_ttft(busy, 200, 4000, 0.0, transfer) > warm  # the queue counts
    assert cold - idle.model.predict([4000]) == pytest.approx(0.001 + 4000e-6)


def test_seed_ignores_a_report_torn_mid_pass() -> None:
    """The measured case: a 3-token warm-up pass done (10.6 ms) and a 2,810-token prompt admitted
    but not yet timed read as 3.8 µs per token; seeding from it made one instance look
    10-15× faster than its peers. Such small totals must leave the prior alone."""
    model = BatchTimeModel()
    prior = model.per_token()
    model.seed_per_token(0.0106, 2813)
    assert model.per_token() == pytest.approx(prior)
    model.seed_per_token(55e-6 * 4 * MIN_SEED_TOKENS, 4 * MIN_SEED_TOKENS)  # many batches: trusted
    assert model.per_token() == pytest.approx(55e-6)


def test_report_credit_is_one_batch_and_is_used_up_by_sends() -> None:
    clock = InstanceClock("w")
    assert not clock.starved()
    clock.on_report(0, default_batch_tokens=8192)  # nothing measured yet: the default batch
    assert clock.starved() and clock.credit_tokens == 8192
    clock.on_sent("a", 5000, 0.0)
    assert clock.starved()  # 3,192 tokens of the batch are still free
    clock.on_sent("b", 5000, 0.0)
    assert not clock.starved()
    clock.on_report(0)  # reported empty again: measured batches set the credit now
    clock.batch_tokens = 6000.0
    clock.on_report(0)
    assert clock.credit_tokens == 6000.0
    clock.on_report(3)  # something is waiting there: no credit
    assert not clock.starved()


def test_oas_policy_counts_an_instance_short_of_work_until_two_batches_are_out() -> None:
    """The policy's work-conservation test: model-free (tokens out), or the worker's report."""
    policy = OASPolicy(PolicyContext(RouterConfig(), PrefixIndex(), Role.PREFILL))
    jit_only = OASJitOnly(PolicyContext(RouterConfig(), PrefixIndex(), Role.PREFILL))
    clock = InstanceClock("w")
    clock.model.seed_per_token(1.0 * MIN_SEED_TOKENS, MIN_SEED_TOKENS)  # a model: 1 s per token
    clock.on_sent("a", 8000, 0.0)
    assert clock.queue_seconds(0.0) > 1000  # the prediction alone would hold everything
    assert policy.queue.is_open(clock, 0.0) and not jit_only.queue.is_open(clock, 0.0)
    clock.on_sent("b", 8400, 0.0)  # two batches (2 × 8,192 tokens) are out now
    assert not policy.queue.is_open(clock, 0.0)
    clock.on_report(0)  # ... but the worker says nothing is waiting: one batch of credit
    assert policy.queue.is_open(clock, 0.0)
    clock.on_report(2)
    assert not policy.queue.is_open(clock, 0.0)


def test_the_ttft_objective_reaches_the_queue_order() -> None:
    from omniinfer.proxy.oas.deferred_queue import Waiting
    from omniinfer.proxy.oas.policy import OASNoSLO

    config = RouterConfig(oas_ttft_slo_secs=1.0)
    lost, fresh_long = Waiting("lost", 100, 0.01, 0.0), Waiting("fresh", 5000, 0.5, 1.4)
    with_slo = OASPolicy(PolicyContext(config, PrefixIndex(), Role.PREFILL))
    without = OASNoSLO(PolicyContext(config, PrefixIndex(), Role.PREFILL))
    plain = OASPolicy(PolicyContext(RouterConfig(), PrefixIndex(), Role.PREFILL))
    # at t=1.5 "lost" has waited past the objective; "fresh" can still make it
    assert [w.key for w in with_slo.queue.order([lost, fresh_long], 1.5)] == ["fresh", "lost"]
    assert [w.key for w in without.queue.order([lost, fresh_long], 1.5)] == ["lost", "fresh"]
    assert [w.key for w in plain.queue.order([lost, fresh_long], 1.5)] == ["lost", "fresh"]


def test_a_variant_can_only_change_existing_switches() -> None:
    from omniinfer.proxy.oas import policy as oas

    with pytest.raises(TypeError, match="no switch deferr"):
        oas._variant("oas_typo", deferr=False)
    assert oas.OASNoDefer.defer is False and oas.OASPolicy.defer is True
    assert oas.OASNoDefer.name == "oas_no_defer"


def test_no_defer_sends_to_a_busy_instance_at_once_where_oas_holds() -> None:
    """One prefill instance already working off a 40K-token prompt: ``oas`` holds the next
    request (its prediction says busy, and more than two batches are out), ``oas_no_defer``
    sends it there at once."""
    import asyncio

    from omniinfer.proxy.oas.policy import OASNoDefer
    from omniinfer.proxy.policy_api import RouteRequest
    from omniinfer.proxy.workers import Worker

    async def second(cls: type[OASPolicy]) -> tuple[int, bool]:
        policy = cls(PolicyContext(RouterConfig(), PrefixIndex(), Role.PREFILL))
        worker = Worker("http://127.0.0.1:1", Role.PREFILL, healthy=True)
        first = await policy.schedule(RouteRequest("big", 40000, 8), [worker])
        assert first is not None and first.reason == "idle"
        task = asyncio.ensure_future(policy.schedule(RouteRequest("next", 64, 8), [worker]))
        await asyncio.sleep(0)  # the task runs until it is released or parked
        released = task.done()
        task.cancel()
        return len(policy.queue), released

    assert asyncio.run(second(OASPolicy)) == (1, False)
    assert asyncio.run(second(OASNoDefer)) == (0, True)


def test_goodput_and_moore_hodgson_variants_reach_the_queue() -> None:
    from omniinfer.proxy.oas.deferred_queue import Waiting
    from omniinfer.proxy.oas.policy import OASAged, OASGoodput, OASMooreHodgson

    def make(cls: type[OASPolicy], slo: float) -> OASPolicy:
        return cls(PolicyContext(RouterConfig(oas_ttft_slo_secs=slo), PrefixIndex(), Role.PREFILL))

    oas, goodput = make(OASAged, 10.0), make(OASGoodput, 10.0)
    clock = InstanceClock("w")  # no cycle measured yet: the 0.2 s default
    assert oas.queue.max_hold([clock]) == pytest.approx(0.2 * (1 + 8))
    assert goodput.queue.max_hold([clock]) == pytest.approx(0.2 * (1 + 32))
    assert make(OASPolicy, 10.0).queue.max_hold([clock]) == pytest.approx(0.2 * (1 + 32))
    old_long, new_short = Waiting("old_long", 5000, 0.5, 0.0), Waiting("new_short", 100, 0.01, 2.9)
    # 3 s of waiting outweigh 2 × 0.49 s of extra compute for aging, not for shortest-first
    assert [w.key for w in oas.queue.order([old_long, new_short], 3.0)] == ["old_long", "new_short"]
    assert [w.key for w in goodput.queue.order([old_long, new_short], 3.0)] == [
        "new_short", "old_long"]
    # Moore–Hodgson reads the work already sent to the instances from their clocks
    mh = make(OASMooreHodgson, 1.0)
    older, newer = Waiting("older", 3000, 0.3, 0.0), Waiting("newer", 100, 0.1, 0.05)
    mh.clocks["w"] = clock
    assert [w.key for w in mh.queue.order([newer, older], 0.1)] == ["older", "newer"]
    clock.model.seed_per_token(1e-4 * MIN_SEED_TOKENS, MIN_SEED_TOKENS)
    clock.on_sent("x", 7000, 0.1)  # about 0.7 s queued there: "older" can no longer make it
    assert clock.queue_seconds(0.1) > 0.6
    assert [w.key for w in mh.queue.order([newer, older], 0.1)] == ["newer", "older"]


def test_oas_orders_by_the_load_with_an_objective_and_ages_without_one() -> None:
    from omniinfer.proxy.oas.deferred_queue import Waiting

    def make(slo: float | None) -> OASPolicy:
        return OASPolicy(PolicyContext(RouterConfig(oas_ttft_slo_secs=slo), PrefixIndex(),
                                       Role.PREFILL))

    old_long, new_short = Waiting("old_long", 5000, 0.5, 0.0), Waiting("new_short", 100, 0.01, 2.9)
    light = make(10.0)
    light.clocks["w"] = InstanceClock("w")
    assert [w.key for w in light.queue.order([old_long, new_short], 3.0)][0] == "old_long"
    heavy = [old_long, new_short, *(Waiting(f"f{i}", 9000, 1.0, 2.9) for i in range(6))]
    # 6.5 s of waiting work on one instance > half the 10 s objective: shortest first
    assert [w.key for w in light.queue.order(heavy, 3.0)][:2] == ["new_short", "old_long"]
    plain = make(None)
    assert [w.key for w in plain.queue.order(heavy, 3.0)][0] == "old_long"


def test_observed_delay_is_a_high_quantile_of_the_excess_over_predicted_compute() -> None:
    delays = ObservedDelay(window=10, quantile=0.9, min_samples=3)
    delays.released("a", 0.0, 0.5)
    delays.done("a", 1.5)  # 1.0 s beyond its compute
    delays.released("b", 0.0, 0.5)
    delays.done("b", 0.2)  # faster than predicted: counts as no delay
    assert delays.value() == 0.0  # fewer than min_samples
    for i in range(8):
        delays.released(f"c{i}", 10.0, 0.1)
        delays.done(f"c{i}", 10.1 + 0.1 * i)
    assert delays.value() == pytest.approx(0.7)
    delays.done("never-released", 99.0)  # unknown keys change nothing
    delays.released("gone", 20.0, 0.1)
    delays.forget("gone")
    delays.done("gone", 120.0)
    assert delays.value() == pytest.approx(0.7)
    for i in range(10):  # the window keeps only the latest
        delays.released(f"d{i}", 30.0, 0.0)
        delays.done(f"d{i}", 32.0)
    assert delays.value() == pytest.approx(2.0)


def test_observed_delay_bounds_its_open_bookings() -> None:
    delays = ObservedDelay(max_open=3)
    for i in range(10):
        delays.released(str(i), 0.0, 0.0)
    assert delays.booked == 3
    for i in range(10):
        delays.done(str(i), 1.0)
    assert list(delays.recent) == [1.0, 1.0, 1.0]  # only the three newest were kept


def test_oas_learns_the_release_to_prefill_delay_and_judges_lateness_with_it() -> None:
    """``oas_edf_obs``: each prefill's delay beyond its predicted compute is measured through
    the hooks (release in the queue, end in ``on_prefill_done``; a failed one is forgotten),
    and a request whose wait plus that delay passes the objective goes after the others."""
    async def run() -> None:
        policy = create_policy("oas_edf_obs", PolicyContext(
            RouterConfig(oas_ttft_slo_secs=2.0), PrefixIndex(), Role.PREFILL))
        p = Worker("http://127.0.0.1:1", Role.PREFILL)
        p.healthy = True
        for i in range(10):
            request = RouteRequest(f"r{i}", 64, 8)
            assert (await policy.schedule(request, [p])).worker is p
            await asyncio.sleep(0.05)
            policy.on_prefill_done(request, p, 0.05)
            policy.on_complete(request, p, True)
        assert len(policy.delays.recent) == 10 and policy.delays.value() >= 0.03
        failed = RouteRequest("failed", 64, 8)
        assert (await policy.schedule(failed, [p])).worker is p
        policy.on_complete(failed, p, False)
        assert len(policy.delays.recent) == 10 and policy.delays.booked == 0
        for i in range(10):  # instances now answer 1.5 s late
            policy.delays.released(f"slow{i}", 0.0, 0.0)
            policy.delays.done(f"slow{i}", 1.5)
        now = policy.now()
        old = Waiting("old", 64, 0.01, now - 1.0)  # 1.0 + 1.5 > 2: late
        young = Waiting("young", 64, 0.01, now - 0.1)
        assert [w.key for w in policy.queue.order([old, young], now)] == ["young", "old"]

    asyncio.run(run())


def test_the_shipped_oas_books_no_delays() -> None:
    """Only the variants that judge lateness with the measured delay pay for measuring it."""
    policy = create_policy("oas", PolicyContext(RouterConfig(oas_ttft_slo_secs=2.0),
                                                PrefixIndex(), Role.PREFILL))
    assert policy.delays is None


def test_the_sticky_variant_charges_a_miss_and_waits_to_redirect_twice(monkeypatch) -> None:
    """``oas_sticky``: the extra compute a miss costs counts twice in the estimate and in the
    wait before a redirect to an idle instance; ``oas`` counts it once."""
    from omniinfer.proxy.oas.policy import OASSticky

    clock = InstanceClock("w")
    clock.model.seed_per_token(1e-5 * MIN_SEED_TOKENS, MIN_SEED_TOKENS)

    class Held:
        prompt_tokens = 4000

        def uncached_tokens(self, worker: object) -> int:
            return 4000

    item = Waiting("r", 4000, 0.04, 0.0)
    estimates, waits = {}, {}
    for cls in (OASPolicy, OASSticky):
        policy = cls(PolicyContext(RouterConfig(), PrefixIndex(), Role.PREFILL))
        monkeypatch.setattr(policy, "placement", lambda item, inst: (Held(), object(), inst))
        monkeypatch.setattr(cls, "_extra_compute", staticmethod(lambda item, clock, n: 0.3))
        waits[cls.name] = policy._redirect_wait(item, clock)
        estimates[cls.name] = policy.estimate(item, clock, 0.0)
    assert waits == {"oas": pytest.approx(0.3), "oas_sticky": pytest.approx(0.6)}
    assert estimates["oas_sticky"] - estimates["oas"] == pytest.approx(0.3)
