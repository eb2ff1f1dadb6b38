"""Migration plans: few copies, one spare slot per device, every expert served throughout."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from omniinfer.placement.layout import Placement, PlacementError
from omniinfer.placement.migration import (
    MigrationStep,
    align,
    apply_migration,
    experts_moved,
    plan_migration,
)
from omniinfer.placement.static import plan_static


def _same_devices(a: Placement, b: Placement) -> bool:
    """Equal up to slot order inside each device."""
    return all(
        Counter(x.tolist()) == Counter(y.tolist())
        for la, lb in zip(a.slots, b.slots, strict=True)
        for x, y in zip(la, lb, strict=True)
    )


def test_replan_between_domains_replays_exactly(olmoe):
    old = plan_static(olmoe["arxiv"], 16, 16)
    new = plan_static(olmoe["github"], 16, 16)
    plan = plan_migration(old, new, expert_bytes=100)
    result = apply_migration(old, plan.steps)
    assert np.array_equal(result.slots, plan.target.slots)
    # the target is the new plan with devices renumbered: same balance, fewer copies
    assert np.allclose(plan.target.imbalance(olmoe["github"]), new.imbalance(olmoe["github"]))
    assert plan.experts_moved <= experts_moved(old.slots, new.slots)
    assert plan.bytes == 100 * plan.experts_moved
    assert {s.op for s in plan.steps} <= {"ADD", "REMOVE", "SWAP"}


def test_identical_placements_need_no_steps(olmoe):
    old = plan_static(olmoe["c4"], 8, 8)
    shuffled = Placement(old.slots[:, ::-1, ::-1].copy(), old.num_experts)
    assert plan_migration(old, shuffled).steps == []


@pytest.mark.parametrize("seed", range(60))
def test_random_layouts_with_cycles_and_duplicates(seed):
    rng = np.random.default_rng(seed)
    num_devices, width, num_experts = 4, 3, 9
    base = np.concatenate([np.arange(num_experts), rng.integers(0, num_experts, 3)])
    old = Placement(rng.permutation(base).reshape(1, num_devices, width), num_experts)
    new = Placement(rng.permutation(base).reshape(1, num_devices, width), num_experts)
    plan = plan_migration(old, new, expert_bytes=1)
    result = apply_migration(old, plan.steps)
    assert np.array_equal(result.slots, plan.target.slots)
    assert _same_devices(plan.target, align(old, new))
    assert plan.experts_moved <= 2 * experts_moved(old.slots, align(old, new).slots)
    assert sorted(result.slots.ravel().tolist()) == sorted(new.slots.ravel().tolist())


def test_a_pure_exchange_is_one_swap():
    old = Placement(np.array([[[0, 1], [2, 3]]]), 4)
    new = Placement(np.array([[[0, 3], [2, 1]]]), 4)
    plan = plan_migration(old, new, expert_bytes=7)
    assert [s.op for s in plan.steps] == ["SWAP"]
    assert plan.bytes == 14 and plan.experts_moved == 2


def test_replay_rejects_unsafe_steps():
    old = Placement(np.array([[[0, 1], [2, 3]]]), 4)
    with pytest.raises(PlacementError, match="no longer served"):
        apply_migration(old, [MigrationStep("REMOVE", 0, 0, 1, 1)])
    with pytest.raises(PlacementError, match="does not hold"):
        apply_migration(old, [MigrationStep("ADD", 0, 0, 1, 3, source=0)])
    twice = [MigrationStep("ADD", 0, 0, 0, 2, source=1), MigrationStep("ADD", 0, 0, 1, 3, source=1)]
    with pytest.raises(PlacementError, match="second spare"):
        apply_migration(old, twice)
