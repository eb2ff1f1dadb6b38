"""Slot copies of a live migration, computed identically on every rank."""

from __future__ import annotations

import numpy as np
import pytest

from omniinfer.placement.layout import PlacementError
from omniinfer.placement.transfers import logical_counts, plan_slot_copies


def apply(old: np.ndarray, copies: list) -> np.ndarray:  # type: ignore[type-arg]
    out = old.copy()
    for c in copies:
        out[c.layer, c.dst_slot] = old[c.layer, c.src_slot]  # sources read from the old layout
    return out


def test_copies_turn_old_into_new_and_prefer_local_sources() -> None:
    old = np.array([[0, 1, 2, 0, 3, 4, 5, 1]])  # 2 ranks x 4 slots, experts 0..5
    new = np.array([[0, 1, 2, 5, 3, 4, 5, 0]])
    copies = plan_slot_copies(old, new, num_ranks=2, layers=[0])
    assert np.array_equal(apply(old, copies), new)
    by_slot = {c.dst_slot: c for c in copies}
    assert by_slot[3].src_slot == 6 and not by_slot[3].is_local  # expert 5 only on rank 1
    assert by_slot[7].src_slot == 0 and by_slot[7].src_rank == 0  # expert 0 only on rank 0
    assert len(copies) == 2  # unchanged slots are not copied


def test_local_source_wins_over_remote() -> None:
    old = np.array([[0, 1, 1, 2], [0, 1, 2, 3]])
    new = np.array([[0, 1, 2, 2], [0, 1, 2, 3]])
    (copy,) = plan_slot_copies(old, new, num_ranks=2, layers=[0, 1])
    assert copy.dst_slot == 2 and copy.src_slot == 3 and copy.is_local


def test_missing_expert_and_bad_shapes_are_errors() -> None:
    with pytest.raises(PlacementError, match="held nowhere"):
        plan_slot_copies(np.array([[0, 1, 2, 3]]), np.array([[0, 1, 2, 4]]), 2, [0])
    with pytest.raises(PlacementError, match="do not divide"):
        plan_slot_copies(np.array([[0, 1, 2]]), np.array([[0, 1, 2]]), 2, [0])
    with pytest.raises(PlacementError, match="shape"):
        plan_slot_copies(np.array([[0, 1]]), np.array([[0, 1, 2, 3]]), 2, [0])


def test_logical_counts_fold_replicas() -> None:
    physical = np.array([[5, 1, 2, 4]])
    mapping = np.array([[0, 1, 0, 2]])
    assert logical_counts(physical, mapping, 3).tolist() == [[7, 1, 4]]
