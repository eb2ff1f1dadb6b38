"""Shared types of the placement planner: the placement itself, load arithmetic and errors.

A placement of one MoE layer is an int array ``[R, S]``: row ``d`` lists the logical experts whose
weights device ``d`` holds, ``-1`` marks an unused slot (only layer-wise budgets leave some).
Flattened row-major it is SGLang's ``physical_to_logical_map`` row: physical slot ``p`` lives on
device ``p // S``. Tokens of an expert are assumed to split evenly over its replicas, which is
what SGLang's EPLB assumes as well; the imbalance of a layer is B = max device load / mean device
load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

EMPTY = -1


class PlacementError(ValueError):
    """Bad input to the planner; the message is one line meant for the user."""


def replica_counts(slots: np.ndarray, num_experts: int) -> np.ndarray:
    """Copies of each expert in one layer's ``[R, S]`` slots."""
    used = slots[slots >= 0]
    return np.bincount(used, minlength=num_experts)


def slot_loads(slots: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Load served by each slot, ``[R, S]``: an expert's count split evenly over its copies."""
    reps = replica_counts(slots, counts.shape[0])
    per_replica = np.divide(counts, reps, out=np.zeros(counts.shape, float), where=reps > 0)
    loads = per_replica[np.where(slots >= 0, slots, 0)]
    return np.where(slots >= 0, loads, 0.0)


def device_loads(slots: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Load of each device of one layer, ``[R]``."""
    return slot_loads(slots, counts).sum(axis=1)


def imbalance_of_loads(loads: np.ndarray) -> float:
    """B = max / mean; an idle layer counts as perfectly balanced."""
    mean = float(loads.mean())
    return float(loads.max()) / mean if mean > 0 else 1.0


def layer_imbalance(slots: np.ndarray, counts: np.ndarray) -> float:
    """B of one layer's placement under the given expert counts."""
    return imbalance_of_loads(device_loads(slots, counts))


@dataclass
class Placement:
    """Expert placement of all layers: ``slots[L, R, S]`` of logical expert ids (-1 = unused)."""

    slots: np.ndarray
    num_experts: int

    @property
    def num_layers(self) -> int:
        return int(self.slots.shape[0])

    @property
    def num_devices(self) -> int:
        return int(self.slots.shape[1])

    def copy(self) -> Placement:
        return Placement(self.slots.copy(), self.num_experts)

    def imbalance(self, counts: np.ndarray) -> np.ndarray:
        """Per-layer B under ``counts[L, E]``."""
        return np.array([layer_imbalance(s, c) for s, c in zip(self.slots, counts, strict=True)])

    def replicas(self) -> np.ndarray:
        """Copies per expert, ``[L, E]``."""
        return np.stack([replica_counts(s, self.num_experts) for s in self.slots])

    def is_uniform(self) -> bool:
        """True when every slot is used, i.e. SGLang can load it as-is."""
        return bool((self.slots >= 0).all())

    def physical_to_logical_map(self) -> list[list[int]]:
        """SGLang's ``physical_to_logical_map [L][R*S]`` (device of slot p is p // S)."""
        if not self.is_uniform():
            raise PlacementError(
                "layer-wise budgets leave unused slots; SGLang needs the same slot count per layer"
            )
        return self.slots.reshape(self.num_layers, -1).tolist()

    @classmethod
    def from_physical_to_logical_map(
        cls, mapping: np.ndarray | list, num_devices: int, num_experts: int
    ) -> Placement:
        """Inverse of :meth:`physical_to_logical_map`."""
        arr = np.asarray(mapping, dtype=np.int64)
        if arr.ndim != 2:
            raise PlacementError(
                f"physical_to_logical_map must be [layers, slots], got {arr.shape}"
            )
        num_layers, num_slots = arr.shape
        if num_slots % num_devices:
            raise PlacementError(
                f"num devices R={num_devices} does not divide the {num_slots} physical slots"
            )
        return cls(arr.reshape(num_layers, num_devices, num_slots // num_devices), num_experts)


class Predictor(Protocol):
    """Forecasts the next window's expert counts from the windows seen so far."""

    def update(self, counts: np.ndarray) -> None:
        """Feed the counts ``[L, E]`` of the window that just ended."""

    def predict(self) -> np.ndarray:
        """Counts ``[L, E]`` expected in the next window."""
