"""``--omni-placement-window N`` means the same thing to every predictor that has a span, and
the launch refuses it for a predictor that has none."""

from __future__ import annotations

import numpy as np
import pytest

from omniinfer.flags import OmniConfig, OmniFlagError
from omniinfer.placement.dynamic import PREDICTORS, DynamicPlanner
from omniinfer.placement.layout import Placement

SKEWED = np.array([[1.0, 1.0, 1.0, 10.0]] * 2)


def _accepted(predictor: str, window: int | None) -> OmniConfig | None:
    try:
        return OmniConfig.from_mapping({"enable_omni_placement": True,
                                        "omni_placement_predictor": predictor,
                                        "omni_placement_window": window})
    except OmniFlagError:
        return None


@pytest.mark.parametrize("window", [None, 1, 2, 9, 50])
@pytest.mark.parametrize("predictor", sorted(PREDICTORS))
def test_every_accepted_combination_serves_a_working_planner(predictor: str,
                                                             window: int | None) -> None:
    from omniinfer.sglang_plugin.placement.runtime import planner_config

    config = _accepted(predictor, window)
    if config is None:
        return  # refused at launch: the next test says which and how
    initial = Placement(np.array([[[0, 1, 2], [3, 0, 1]]] * 2), 4)
    planner = DynamicPlanner(initial, planner_config(config))
    for _ in range(3):
        result = planner.observe(SKEWED)
    assert result.placement.imbalance(SKEWED).max() < initial.imbalance(SKEWED).max()


def test_the_window_maps_onto_each_predictors_own_span() -> None:
    from omniinfer.placement.dynamic import window_args
    from omniinfer.sglang_plugin.placement.runtime import planner_config

    def served(predictor: str, window: int) -> dict:
        config = OmniConfig.from_mapping({"omni_placement_predictor": predictor,
                                          "omni_placement_window": window})
        return planner_config(config).predictor_args

    assert served("ema", 9) == served("ema-shift", 9) == served("ema-trend", 9) == {"alpha": 0.2}
    assert served("window", 7) == {"size": 7}
    assert window_args("ema", None) == {}


def test_a_window_for_a_predictor_without_one_is_refused_in_one_line() -> None:
    with pytest.raises(OmniFlagError) as info:
        OmniConfig.from_mapping({"omni_placement_predictor": "last", "omni_placement_window": 5})
    message = str(info.value)
    assert message.startswith("--omni-placement-window: ") and "\n" not in message
    assert "'last'" in message
    assert _accepted("last", None) is not None
