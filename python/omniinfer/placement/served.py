"""The planner a server runs for its launch flags (``--omni-placement-*``): one mapping, used by
the placement runtime in each scheduler and by the emulator's MoE clock, so that what the
emulator measures is what a server launched with the same flags plans with. Pure: the flags
table (``omniinfer.flags``) and the planner, no torch, no SGLang."""

from __future__ import annotations

from omniinfer.flags import OmniConfig
from omniinfer.placement.dynamic import DynamicConfig, window_args


def planner_config(config: OmniConfig) -> DynamicConfig:
    """The planner the flags ask for; with none set, the one docs/benchmarks.md measured. The
    window span reaches the predictor as the arguments its registry entry declares."""
    return DynamicConfig(
        trigger=config.omni_placement_trigger, margin=config.omni_placement_margin,
        predictor=config.omni_placement_predictor,
        predictor_args=window_args(config.omni_placement_predictor, config.omni_placement_window))
