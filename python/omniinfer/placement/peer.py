"""SGLang's deepseek EPLB algorithm as the peer in comparisons (never used by the planner).

The algorithm file of the installed SGLang wheel is loaded on its own: importing it through
``sglang.srt`` would pull in the whole serving runtime (over ten seconds) for a pure function.
The file and its function are declared in :mod:`omniinfer.sglang_plugin.internals`
(``DEEPSEEK_REBALANCE``), which finds the file and checks its signature.
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache
from types import ModuleType

import numpy as np

from omniinfer.placement.layout import Placement, PlacementError
from omniinfer.sglang_plugin.internals import DEEPSEEK_REBALANCE, problem, source_file


@lru_cache(maxsize=1)
def _deepseek_module() -> ModuleType:
    wrong = problem(DEEPSEEK_REBALANCE)
    if wrong is not None:
        raise PlacementError(f"SGLang's deepseek EPLB algorithm ({DEEPSEEK_REBALANCE.path}): "
                             f"{wrong}; the EPLB comparison needs it")
    path = source_file(DEEPSEEK_REBALANCE)
    file_spec = importlib.util.spec_from_file_location("_sglang_eplb_deepseek", path)
    if file_spec is None or file_spec.loader is None:
        raise PlacementError(f"SGLang's deepseek EPLB algorithm cannot be loaded from {path}")
    module = importlib.util.module_from_spec(file_spec)
    file_spec.loader.exec_module(module)
    return module


def eplb_plan(
    counts: np.ndarray, num_devices: int, num_redundant: int, num_nodes: int = 1
) -> Placement:
    """Placement by SGLang's ``deepseek`` algorithm (global policy, as SGLang's ``auto`` picks
    for models without expert groups)."""
    import torch

    module = _deepseek_module()
    num_experts = counts.shape[1]
    phy2log, _, _ = module.rebalance_experts(
        torch.as_tensor(np.asarray(counts, dtype=np.float32)),
        num_experts + num_redundant,
        1,
        num_nodes,
        num_devices,
        False,
    )
    return Placement.from_physical_to_logical_map(phy2log.numpy(), num_devices, num_experts)
