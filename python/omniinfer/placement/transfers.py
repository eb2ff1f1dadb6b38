"""From two physical-to-logical maps to the slot copies a live migration must make.

Pure and deterministic: every rank computes the same list from the same maps, so ranks can
pair their sends and receives without talking about them first.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from omniinfer.placement.layout import PlacementError


@dataclass(frozen=True)
class SlotCopy:
    """Copy the weights held in global physical slot ``src_slot`` into ``dst_slot``."""

    layer: int
    dst_slot: int
    src_slot: int
    dst_rank: int
    src_rank: int

    @property
    def is_local(self) -> bool:
        return self.dst_rank == self.src_rank


def plan_slot_copies(
    old_map: np.ndarray, new_map: np.ndarray, num_ranks: int, layers: Iterable[int]
) -> list[SlotCopy]:
    """One copy per slot whose expert changes; a source on the same rank is preferred.

    Sources are read from the *old* layout only, so all copies can run in any order before the
    switch, while the old layout keeps serving.
    """
    old_map, new_map = np.asarray(old_map), np.asarray(new_map)
    if old_map.shape != new_map.shape or old_map.ndim != 2:
        raise PlacementError(f"maps must share a [layers, slots] shape: {old_map.shape} vs {new_map.shape}")
    num_slots = old_map.shape[1]
    if num_ranks < 1 or num_slots % num_ranks:
        raise PlacementError(f"{num_ranks} ranks do not divide {num_slots} physical slots")
    per_rank = num_slots // num_ranks
    copies: list[SlotCopy] = []
    for layer in sorted(set(layers)):
        old, new = old_map[layer], new_map[layer]
        for slot in np.flatnonzero(old != new).tolist():
            expert = int(new[slot])
            holders = np.flatnonzero(old == expert)
            if holders.size == 0:
                raise PlacementError(f"layer {layer}: expert {expert} is held nowhere in the old layout")
            dst_rank = slot // per_rank
            same_rank = holders[holders // per_rank == dst_rank]
            src = int(same_rank[0] if same_rank.size else holders[0])
            copies.append(SlotCopy(layer, slot, src, dst_rank, src // per_rank))
    return copies


def logical_counts(physical: np.ndarray, physical_to_logical: np.ndarray, num_experts: int) -> np.ndarray:
    """Fold per-slot counts ``[L, P]`` into per-expert counts ``[L, E]``."""
    physical = np.asarray(physical, dtype=np.float64)
    mapping = np.asarray(physical_to_logical, dtype=np.int64)
    out = np.zeros((physical.shape[0], num_experts))
    for layer in range(physical.shape[0]):
        valid = mapping[layer] >= 0
        np.add.at(out[layer], mapping[layer][valid], physical[layer][valid])
    return out
