"""OmniPlacement inside SGLang's MoE runtime (expert parallelism).

- :mod:`.plugin`: the HookRegistry wiring on SGLang's EPLB manager and activation recorder;
- :mod:`.runtime`: :class:`~.runtime.PlacementController`, the planner, staging and switch.

Importing this package imports no SGLang.
"""
