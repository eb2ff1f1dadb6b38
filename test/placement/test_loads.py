"""Load model: formats, folding of steps, and one clear error per kind of bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest

from omniinfer.placement.loads import (
    CountsError,
    EmaWindow,
    SlidingWindow,
    fold_steps,
    load_counts,
    read_count_steps,
    validate_counts,
)

STEPS = np.array([[[1, 2, 3], [4, 5, 6]], [[7, 8, 9], [1, 1, 1]], [[0, 0, 6], [2, 2, 2]]], float)


def test_json_csv_and_pt_read_the_same_counts(tmp_path):
    import torch

    (tmp_path / "c.json").write_text(json.dumps({"logical_count": STEPS.tolist()}))
    torch.save({"rank": 0, "logical_count": torch.tensor(STEPS)}, tmp_path / "c.pt")
    (tmp_path / "c.csv").write_text("# layers x experts\n8,10,18\n7,8,9\n")
    assert np.array_equal(read_count_steps(tmp_path / "c.json"), STEPS)
    assert np.array_equal(read_count_steps(tmp_path / "c.pt"), STEPS)
    assert np.array_equal(load_counts(tmp_path / "c.csv"), STEPS.sum(axis=0))
    assert np.array_equal(load_counts(tmp_path / "c.json"), STEPS.sum(axis=0))


def test_window_and_ema_weigh_recent_steps():
    assert np.array_equal(fold_steps(STEPS, "window", window=2), STEPS[1:].sum(axis=0))
    ema = fold_steps(STEPS, "ema", alpha=0.5)
    assert np.allclose(ema, 0.5 * STEPS[2] + 0.25 * STEPS[1] + 0.25 * STEPS[0])
    window = SlidingWindow(1).extend(STEPS)
    assert np.array_equal(window.total(), STEPS[-1])
    with pytest.raises(CountsError):
        EmaWindow(0.0)


@pytest.mark.parametrize(
    "counts, message",
    [
        (np.ones(5), "matrix"),
        (np.ones((2, 3, 4)), "matrix"),
        (np.array([[1.0, np.nan]]), "NaN"),
        (np.array([[1.0, -1.0]]), "negative"),
        (np.array([[1.0, 2.0], [0.0, 0.0]]), "layer 1 has no routed tokens"),
    ],
)
def test_bad_counts_give_one_clear_error(counts, message):
    with pytest.raises(CountsError, match=message) as info:
        validate_counts(counts)
    assert "\n" not in str(info.value)
    assert isinstance(info.value, ValueError)


def test_bad_files(tmp_path):
    with pytest.raises(CountsError, match="not found"):
        read_count_steps(tmp_path / "missing.json")
    (tmp_path / "x.json").write_text('{"something": 1}')
    with pytest.raises(CountsError, match="logical_count"):
        read_count_steps(tmp_path / "x.json")
    (tmp_path / "x.txt").write_text("1,2")
    with pytest.raises(CountsError, match="unknown counts format"):
        read_count_steps(tmp_path / "x.txt")
    (tmp_path / "r.csv").write_text("1,2,3\n4,5\n")
    with pytest.raises(CountsError, match="different lengths"):
        read_count_steps(tmp_path / "r.csv")


def test_packaged_domain_counts(olmoe, mixtral):
    assert set(olmoe) >= {"arxiv", "book", "c4", "github", "wikipedia"}
    assert all(c.shape == (3, 64) for c in olmoe.values())
    assert all(c.shape == (3, 8) for c in mixtral.values())
    # top-8 routing: every layer sees the same number of assignments
    assert np.allclose(olmoe["arxiv"].sum(axis=1), olmoe["arxiv"].sum(axis=1)[0])
