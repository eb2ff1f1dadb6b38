"""Algorithm 2: predictors, the trigger/margin rule, cheap repairs, and the drift comparison."""

from __future__ import annotations

import numpy as np
import pytest

from omniinfer.placement.dynamic import (
    PREDICTORS,
    DynamicConfig,
    DynamicPlanner,
    make_predictor,
    register_predictor,
    repair_layer,
)
from omniinfer.placement.layout import PlacementError, layer_imbalance
from omniinfer.placement.migration import experts_moved
from omniinfer.placement.simulate import DriftConfig, drift_workload, run_policy
from omniinfer.placement.static import plan_static
from omniinfer.placement.transfers import plan_slot_copies


def test_registry_has_the_measured_predictors():
    assert {"last", "window", "ema", "ema-trend", "ema-shift"} <= set(PREDICTORS)
    with pytest.raises(PlacementError, match="unknown predictor"):
        make_predictor("crystal-ball")

    @register_predictor("test-constant")
    class Constant:
        def update(self, counts):
            self.shape = counts.shape

        def predict(self):
            return np.ones(self.shape)

    try:
        p = make_predictor("test-constant")
        p.update(np.zeros((2, 3)))
        assert p.predict().shape == (2, 3)
    finally:
        PREDICTORS.pop("test-constant")


def test_ema_shift_restarts_on_a_regime_shift_and_smooths_noise():
    rng = np.random.default_rng(0)
    a = np.array([[0.4, 0.3, 0.2, 0.1]])
    b = a[:, ::-1]
    shift, ema = make_predictor("ema-shift"), make_predictor("ema")
    for _ in range(20):
        sample = rng.multinomial(20000, a[0])[None].astype(float)
        shift.update(sample)
        ema.update(sample)
    new = rng.multinomial(20000, b[0])[None].astype(float)
    shift.update(new)
    ema.update(new)
    err = lambda p: np.abs(p.predict() / p.predict().sum() - b).sum()  # noqa: E731
    assert err(shift) < 0.05 < err(ema)


def test_repair_lowers_b_within_its_move_budget(olmoe):
    old = plan_static(olmoe["arxiv"], 16, 16).slots[0]
    load = olmoe["github"][0]
    repaired = repair_layer(old, load, max_moves=6)
    assert experts_moved(old, repaired) <= 6
    assert layer_imbalance(repaired, load) < layer_imbalance(old, load) - 0.05


def test_planner_adopts_only_above_trigger_and_margin(olmoe):
    start = plan_static(olmoe["arxiv"], 16, 16)
    planner = DynamicPlanner(start, DynamicConfig(predictor="last", trigger=1.05, margin=0.01))
    quiet = planner.observe(olmoe["arxiv"])
    assert quiet.experts_moved == 0 and quiet.adopted_layers == []
    moved = planner.observe(olmoe["github"])
    assert moved.adopted_layers and moved.experts_moved > 0
    # the count is the copies a live migration makes from the old layout to the new one
    copies = plan_slot_copies(start.slots.reshape(start.num_layers, -1),
                              moved.placement.slots.reshape(start.num_layers, -1),
                              start.slots.shape[1], range(start.num_layers))
    assert moved.experts_moved == len(copies) == experts_moved(start.slots, moved.placement.slots)
    after = moved.placement.imbalance(olmoe["github"])
    assert (
        after[moved.adopted_layers] < start.imbalance(olmoe["github"])[moved.adopted_layers]
    ).all()


def test_omni_beats_periodic_eplb_under_drift_with_fewer_moves(olmoe):
    counts, _ = drift_workload(olmoe, DriftConfig(windows=60, seed=7))
    omni_b, omni = run_policy("omni", counts, 16, 16)
    eplb_b, eplb = run_policy("eplb-periodic", counts, 16, 16, period=10)
    assert omni_b.mean() - 1 < 0.7 * (eplb_b.mean() - 1)
    assert omni.moved < eplb.moved
