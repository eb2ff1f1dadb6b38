"""SGLang's deepseek EPLB algorithm as the peer in comparisons (never used by the planner).

The algorithm file of the installed SGLang wheel is loaded on its own: importing it through
``sglang.srt`` would pull in the whole serving runtime (over ten seconds) for a pure function.
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache
from pathlib import Path
from types import ModuleType

import numpy as np

from omniinfer.placement.base import Placement, PlacementError


@lru_cache(maxsize=1)
def _deepseek_module() -> ModuleType:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise PlacementError("SGLang is not installed; the EPLB comparison needs it")
    root = Path(next(iter(spec.submodule_search_locations)))
    path = root / "srt" / "eplb" / "eplb_algorithms" / "deepseek.py"
    file_spec = importlib.util.spec_from_file_location("_sglang_eplb_deepseek", path)
    if file_spec is None or file_spec.loader is None or not path.is_file():
        raise PlacementError(f"SGLang's deepseek EPLB algorithm not found at {path.name}")
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
