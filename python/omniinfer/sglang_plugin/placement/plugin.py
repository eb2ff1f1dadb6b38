"""HookRegistry wiring of OmniPlacement in scheduler processes (see :mod:`.runtime`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from sglang.srt.plugins.hook_registry import HookType

from omniinfer.flags import OmniConfig
from omniinfer.sglang_plugin import hooks, internals, targets

logger = logging.getLogger("omniinfer")


class _State:
    config: OmniConfig | None = None
    controller: Any = None


def _around_forward_pass_end(_original: Callable[..., Any], manager: Any) -> None:
    """Replaces SGLang's fixed-period rebalance with the OmniPlacement controller."""
    if _State.controller is None:
        from omniinfer.sglang_plugin.placement.runtime import PlacementController

        assert _State.config is not None
        _State.controller = PlacementController(manager, _State.config)
    _State.controller.on_forward_pass_end()


def _after_accumulator_append(_result: Any, accumulator: Any, *args: Any, **kwargs: Any) -> None:
    """Hands the pass's ``global_physical_count`` to the controller; the argument is found by
    binding the call to ``_StatAccumulator.append``'s declared signature."""
    controller = _State.controller
    if controller is None:
        return
    bound = internals.bind(internals.STAT_ACCUMULATOR_APPEND, (accumulator, *args), kwargs)
    data = bound.arguments.get("single_pass_data")
    if isinstance(data, dict) and "global_physical_count" in data:
        controller.on_counts(data["global_physical_count"])


def register(config: OmniConfig) -> None:
    _State.config = config
    hooks.register(targets.EPLB_FORWARD_PASS_END, _around_forward_pass_end, HookType.AROUND)
    hooks.register(targets.STAT_ACCUMULATOR_APPEND, _after_accumulator_append, HookType.AFTER)
