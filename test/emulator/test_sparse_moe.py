"""The MoE term of the emulator: the B clock over real routing counts, the placements, the cost.

Pure and fast (no HTTP): ``MoeClock`` driven by hand, and the engine with time scale 0.
"""

from __future__ import annotations

import asyncio
import dataclasses
from importlib import resources

import numpy as np
import pytest
import yaml
from emu_helpers import small_profile

from omniinfer.emulator.engine import EmulatedEngine, EmuRequest
from omniinfer.emulator.interfaces import PrefillItem
from omniinfer.emulator.profile import Profile, ProfileError, load_profile, profile_from_dict
from omniinfer.emulator.sparse import (
    CHUNK_SEED_STRIDE,
    MOE_MODELS,
    MoeClock,
    MoeConfig,
    MoeStep,
    contiguous,
    skew_counts,
)
from omniinfer.placement.loads import read_domain_counts
from omniinfer.placement.migration import experts_moved
from omniinfer.placement.simulate import EXPERT_BYTES, DriftConfig, drift_workload
from omniinfer.placement.static import plan_static

LAYOUT = {"ranks": 8, "redundant": 8}  # olmoe: 64 experts + 8 redundant = 9 slots per device


def clock(**changes: object) -> MoeClock:
    return MoeClock(MoeConfig(**{"share": 0.4, "window_steps": 1, **LAYOUT, **changes}))


def run(moe: MoeClock, steps: int, pass_s: float = 0.02) -> list[float]:
    """B of ``steps`` passes of ``pass_s`` each (plus their stalls) on the model clock."""
    now, out = 0.0, []
    for _ in range(steps):
        step = moe.step(now)
        now += step.stall_s + pass_s * step.factor
        out.append(step.b)
    return out


def stream(seed: int = 0, skew: float = 1.0) -> np.ndarray:
    """The first chunk of the drift stream, rebuilt from the placement module alone."""
    domains = {k: skew_counts(v, skew) for k, v in read_domain_counts(model="olmoe").items()}
    return drift_workload(domains, DriftConfig(seed=seed * CHUNK_SEED_STRIDE))[0]


def test_defaults_are_off_and_the_engine_has_no_clock() -> None:
    cfg = MoeConfig()
    assert not cfg.active and cfg.share == 0.0 and cfg.placement == "none"
    profile = profile_from_dict({"model": {"model_path": "m"}})
    assert profile.moe == cfg
    assert EmulatedEngine(profile).moe is None


def test_b_is_the_placement_against_the_window_and_the_factor_is_the_share_formula() -> None:
    moe = clock(placement="none", window_steps=3)
    counts = stream()
    trivial = contiguous(3, 64, 8)
    for k in range(9):
        step = moe.step(0.0)
        window = 1 + k // 3  # window 0 seeds the planners; passes 0..2 run on window 1
        b = float(trivial.imbalance(counts[window]).mean())
        assert step.window == window and step.b == pytest.approx(b)
        assert step.b > 1.1  # OLMoE's routing on the trivial layout is far from balanced
        assert step.factor == pytest.approx(0.6 + 0.4 * b)
        assert step.stall_s == 0.0


def test_b_ref_divides_b_and_share_zero_is_exactly_one() -> None:
    b = clock(placement="none").step(0.0).b
    assert clock(placement="none", b_ref=b).step(0.0).factor == pytest.approx(1.0)
    assert clock(placement="none", b_ref=1.25).step(0.0).factor == pytest.approx(0.6 + 0.4 * b / 1.25)
    assert clock(placement="none", share=0.0).step(0.0).factor == 1.0


def test_skew_tilts_the_expert_shares() -> None:
    counts = np.array([[1.0, 2.0, 5.0]])
    assert np.allclose(skew_counts(counts, 2.0), [[1 / 30 * 8, 4 / 30 * 8, 25 / 30 * 8]])
    assert np.allclose(skew_counts(counts, 0.0), [[8 / 3, 8 / 3, 8 / 3]])
    assert np.array_equal(skew_counts(counts, 1.0), counts)
    even, uneven = (np.mean(run(clock(placement="none", skew=s), 10)) for s in (0.5, 2.0))
    assert uneven > even > 1.0


def test_static_plans_once_and_omni_brings_b_down_over_windows_vs_none() -> None:
    none, static, omni = (clock(placement=p) for p in ("none", "static", "omni"))
    b = {name: np.array(run(m, 60)) for name, m in (("none", none), ("static", static), ("omni", omni))}
    assert b["omni"].mean() < b["static"].mean() < b["none"].mean()
    assert b["omni"][30:].mean() < b["static"][30:].mean() - 0.05  # static ages as the mix drifts
    assert static.rebalances == 0 and static.in_force.slots.tolist() == plan_static(
        stream()[0], 8, 8).slots.tolist()
    assert omni.rebalances > 0 and omni.experts_moved > 0 and omni.bytes_moved > 0
    assert omni.stalls == 0 and omni.stall_total_s == 0.0  # omni migrates in the background
    status = omni.status()
    assert status["b_mean"] == pytest.approx(b["omni"].mean()) and status["steps"] == 60


def test_omni_placement_takes_effect_only_after_its_bytes_have_moved() -> None:
    slow = clock(placement="omni", migration_gb_s=1e-6)  # a migration would take hours
    first = slow.in_force
    b = run(slow, 20)
    assert slow.rebalances > 0 and slow.status()["migrations_pending"] == slow.rebalances
    assert slow.in_force is first  # still serving on the first plan
    fixed = [float(first.imbalance(stream()[w]).mean()) for w in range(1, 21)]
    assert b == pytest.approx(fixed)
    # at the default bandwidth one pass is long enough for a migration to land
    fast = clock(placement="omni")
    run(fast, 20, pass_s=10.0)
    pending = fast.status()["migrations_pending"]
    assert fast.rebalances > 0 and pending <= 1  # only one opened by the last pass may be in flight
    assert fast._version == fast.rebalances - pending


def test_eplb_rebalances_every_period_and_stalls_for_bytes_over_bandwidth() -> None:
    moe = clock(placement="eplb", eplb_period=2)
    before = moe.in_force
    assert [moe.step(0.0).stall_s for _ in range(2)] == [0.0, 0.0]  # windows 1, 2
    step = moe.step(0.0)  # opens window 3: EPLB saw windows 1 and 2 and rebalanced
    moved = experts_moved(before.slots, moe.in_force.slots)
    assert moved > 0 and moe.rebalances == 1 and moe.experts_moved == moved
    layers = MOE_MODELS["olmoe"][1] / 3  # the 3 recorded layers stand in for the model's 16
    expected = moved * EXPERT_BYTES["olmoe"] * layers / 40e9
    assert step.stall_s == pytest.approx(expected) and moe.stall_total_s == pytest.approx(expected)
    assert step.b == pytest.approx(float(moe.in_force.imbalance(stream()[3]).mean()))
    assert moe.step(0.0).stall_s == 0.0  # the next rebalance comes two windows later
    custom = clock(placement="eplb", eplb_period=1, expert_bytes=1000, layers=30, migration_gb_s=1.0)
    custom.step(0.0)
    first = custom.in_force
    stall = custom.step(0.0).stall_s
    assert stall == pytest.approx(experts_moved(first.slots, custom.in_force.slots) * 1000 * 10 / 1e9)


def test_eplb_plans_with_sglangs_algorithm_on_the_counts_since_its_last_rebalance() -> None:
    """SGLang's recorder buffer is as long as the rebalance interval: each EPLB pass sees the
    windows since the previous one, summed, and nothing older; the start is a plan on a recorded
    distribution (``--init-expert-location``, the best-configured peer), not the trivial layout."""
    from omniinfer.placement.peer import eplb_plan

    counts = stream()
    moe = clock(placement="eplb", eplb_period=2)
    assert moe.in_force.slots.tolist() == eplb_plan(counts[0], 8, 8).slots.tolist()
    assert moe.in_force.slots.tolist() != contiguous(3, 64, 8).slots.tolist()
    for _ in range(3):
        moe.step(0.0)  # the third pass opens window 3: EPLB saw windows 1 and 2
    assert moe.in_force.slots.tolist() == eplb_plan(counts[1] + counts[2], 8, 8).slots.tolist()
    assert moe.in_force.slots.tolist() != eplb_plan(counts[2], 8, 8).slots.tolist()
    for _ in range(2):
        moe.step(0.0)  # window 5: windows 3 and 4 only
    assert moe.in_force.slots.tolist() == eplb_plan(counts[3] + counts[4], 8, 8).slots.tolist()
    assert moe.in_force.slots.tolist() != eplb_plan(counts[1:5].sum(axis=0), 8, 8).slots.tolist()


def test_oracle_is_a_floor() -> None:
    oracle, omni = clock(placement="oracle"), clock(placement="omni")
    assert np.mean(run(oracle, 10)) < np.mean(run(omni, 10))
    assert oracle.rebalances == 0 and oracle.stall_total_s == 0.0


def test_the_stream_continues_past_one_chunk() -> None:
    moe = MoeClock(MoeConfig(share=0.5, window_steps=1, **LAYOUT), drift=DriftConfig(windows=4, regime=2))
    b = run(moe, 12)
    assert moe.window == 12 and len(set(b)) == 12  # new windows keep coming, each its own sample


def test_bad_settings_are_refused() -> None:
    for bad in ({"share": 1.5}, {"placement": "round-robin"}, {"model": "gpt"}, {"ranks": 3},
                {"ranks": 8, "redundant": 3, "placement": "omni"}, {"window_steps": 0},
                {"b_ref": 0.0}, {"skew": -1.0}):
        with pytest.raises(ValueError):
            MoeConfig(**bad)  # type: ignore[arg-type]
    with pytest.raises(ProfileError, match="moe"):
        profile_from_dict({"model": {"model_path": "m"}, "moe": {"placement": "nope"}})
    with pytest.raises(ProfileError, match="unknown field"):
        profile_from_dict({"model": {"model_path": "m"}, "moe": {"sharee": 0.1}})
    moe = profile_from_dict({"model": {"model_path": "m"}, "moe": {"share": 0.3, "placement": "static",
                                                                   "ranks": 4, "redundant": 4}}).moe
    assert (moe.share, moe.placement, moe.ranks, moe.redundant) == (0.3, "static", 4, 4)


# ---------------------------------------------------------------------------- the engine


def moe_profile(chunk: int = 4096, **moe: object) -> Profile:
    return small_profile(
        "moe", {"chunked_prefill_size": chunk},
        moe=MoeConfig(**{"share": 0.5, "window_steps": 1, **LAYOUT, **moe}),  # type: ignore[arg-type]
    )


def run_engine(profile: Profile, prompt: int, new: int) -> tuple[EmulatedEngine, list[tuple[float, float]]]:
    """One request through an engine; returns it and each pass's (factor, stall)."""
    engine = EmulatedEngine(profile, time_scale=0)
    assert engine.moe is not None
    seen: list[tuple[float, float]] = []
    step = engine.moe.step

    def spy(now_s: float) -> MoeStep:
        result = step(now_s)
        seen.append((result.factor, result.stall_s))
        return result

    engine.moe.step = spy  # type: ignore[method-assign]

    async def main() -> None:
        request = engine.submit(EmuRequest(list(range(1000, 1000 + prompt)), new))
        engine.start()
        while not request.finished:
            await request.wait_progress()
        await engine.stop()

    asyncio.run(main())
    return engine, seen


def test_engine_scales_every_pass_by_the_clock_factor() -> None:
    engine, seen = run_engine(moe_profile(placement="none"), 100, 6)
    cost = engine.cost
    dense_prefill = cost.prefill_time([PrefillItem(100, 0)])
    dense_decode = [cost.decode_time(1, 100 + k) for k in range(1, 6)]
    assert len(seen) == 6 and all(factor > 1.05 for factor, _ in seen)
    assert engine.stats.prefill_busy_s == pytest.approx(dense_prefill * seen[0][0])
    assert engine.stats.decode_busy_s == pytest.approx(sum(t * f for t, (f, _) in zip(dense_decode, seen[1:], strict=True)))
    assert engine.model_time > dense_prefill + sum(dense_decode)
    assert engine.moe is not None and engine.moe.steps == 6


def test_engine_pays_the_eplb_stall_in_model_time() -> None:
    engine, seen = run_engine(moe_profile(placement="eplb", eplb_period=1), 100, 6)
    cost = engine.cost
    passes = [cost.prefill_time([PrefillItem(100, 0)])] + [cost.decode_time(1, 100 + k) for k in range(1, 6)]
    stalls = [stall for _, stall in seen]
    assert sum(stalls) > 0 and engine.moe is not None and engine.moe.stalls >= 1
    assert engine.model_time == pytest.approx(sum(s + t * f for t, (f, s) in zip(passes, seen, strict=True)))
    assert engine.stats.decode_busy_s + engine.stats.prefill_busy_s == pytest.approx(
        engine.model_time - sum(stalls))  # busy time is the passes; the stall is counted apart


def test_prefill_passes_pay_the_stall_too() -> None:
    engine, seen = run_engine(moe_profile(chunk=256, placement="eplb", eplb_period=1), 1000, 1)
    cost = engine.cost
    chunks = [cost.prefill_time([PrefillItem(256, 256 * k)]) for k in range(3)]
    chunks.append(cost.prefill_time([PrefillItem(232, 768)]))
    assert len(seen) == 4 and sum(stall for _, stall in seen) > 0
    assert engine.model_time == pytest.approx(sum(s + t * f for t, (f, s) in zip(chunks, seen, strict=True)))


def test_shipped_profiles_keep_their_sparse_terms_commented_and_valid() -> None:
    for name in ("ascend-r1-prefill", "ascend-r1-decode"):
        profile = load_profile(name)
        assert not profile.moe.active and not profile.attn_pattern.active  # unchanged behaviour
        text = resources.files("omniinfer.emulator").joinpath("profiles", f"{name}.yaml").read_text()
        block = text.split("# Optional sparse terms", 1)[1].splitlines()[2:]
        raw = yaml.safe_load(text)
        raw.update(yaml.safe_load("\n".join(line[2:] for line in block if line.startswith("# "))))
        enabled = profile_from_dict(raw, name)
        assert enabled.moe.active and enabled.moe.layers == 58 and enabled.attn_pattern.active
        moe = MoeClock(dataclasses.replace(enabled.moe, placement="static"))
        assert moe.layer_scale == pytest.approx(58 / 3) and moe.expert_bytes == 3 * 7168 * 2048
