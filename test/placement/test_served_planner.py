"""The placement runtime serves the planner the benchmarks measured, unless flags say otherwise."""

from __future__ import annotations

import pytest

from omniinfer.flags import OmniConfig, OmniFlagError
from omniinfer.placement.dynamic import DynamicConfig


def test_default_flags_serve_the_benchmarked_planner() -> None:
    from omniinfer.placement.served import planner_config

    assert planner_config(OmniConfig()) == DynamicConfig()  # ema-shift, 1.05, 0.01


def test_flags_change_the_served_planner_and_bad_ones_are_refused() -> None:
    from omniinfer.placement.served import planner_config

    served = planner_config(OmniConfig.from_mapping({
        "omni_placement_predictor": "ema", "omni_placement_window": 9,
        "omni_placement_trigger": 1.2, "omni_placement_margin": 0.05}))
    assert (served.predictor, served.predictor_args, served.trigger, served.margin) == (
        "ema", {"alpha": 0.2}, 1.2, 0.05)
    with pytest.raises(OmniFlagError, match="unknown predictor 'oracle'"):
        OmniConfig.from_mapping({"omni_placement_predictor": "oracle"})
