"""The retrieval-aware front's pure rules: layer ranking, judged points, the shipped point."""

from __future__ import annotations

import pytest

from omniinfer.attn.front import FrontPoint, Judged, binding_bounds, rank_layers, shipped_point


def _judged(ppl: float, loss: float, layers: tuple[int, ...] = (0,)) -> Judged:
    return Judged(layers=layers, kv_saved=0.1 * len(layers), ppl_drop=ppl, worst_text="t",
                  retrieval_loss=loss, worst_band=None if loss == 0 else "passkey/r/0.4-0.6")


def test_layers_rank_by_both_costs_each_over_its_largest() -> None:
    # layer 0: cheap on perplexity, costly on the key; layer 2: the reverse; layer 1 in between
    # on both; layer 3 helps the key (clipped to nothing) and costs a little perplexity
    order = rank_layers([0.001, 0.004, 0.010, 0.002], [8.0, 3.0, 0.5, -2.0])
    assert order == [3, 1, 2, 0]
    # the same costs on another scale rank the same: each measure counts over its largest
    assert rank_layers([0.1, 0.4, 1.0, 0.2], [80.0, 30.0, 5.0, -20.0]) == order


def test_ties_keep_the_lower_layer_first_and_bad_input_is_refused() -> None:
    assert rank_layers([0.0, 0.0, 0.0], [0.0, 0.0, 0.0]) == [0, 1, 2]
    with pytest.raises(ValueError):
        rank_layers([0.1], [0.1, 0.2])
    with pytest.raises(ValueError):
        rank_layers([], [])


def test_a_point_holds_only_within_both_bounds_and_beats_only_when_no_worse() -> None:
    assert _judged(0.009, 5.0).holds(0.01, 5.0)
    assert not _judged(0.011, 0.0).holds(0.01, 5.0)
    assert not _judged(0.0, 10.0).holds(0.01, 5.0)
    assert _judged(0.005, 0.0).beats(_judged(0.006, 0.0))
    assert not _judged(0.005, 10.0).beats(_judged(0.006, 0.0))  # better on one, worse on other
    assert not _judged(0.005, 0.0).beats(_judged(0.005, 0.0))  # equal is not better


def test_the_largest_holding_point_ships_and_the_next_one_says_what_binds() -> None:
    front = [FrontPoint(4, _judged(0.002, 0.0), _judged(0.003, 25.0)),
             FrontPoint(6, _judged(0.006, 0.0), _judged(0.004, 25.0)),
             FrontPoint(8, _judged(0.009, 50.0), _judged(0.02, 50.0)),
             FrontPoint(10, _judged(0.015, 50.0), _judged(0.03, 50.0))]
    shipped = shipped_point(front, 0.01, 5.0)
    assert shipped is not None and shipped.k == 6
    assert binding_bounds(front, shipped, 0.01, 5.0) == ["retrieval"]
    assert binding_bounds(front, front[-1], 0.01, 5.0) == []  # nothing larger was judged
    none = [FrontPoint(4, _judged(0.02, 25.0), _judged(0.02, 25.0))]
    assert shipped_point(none, 0.01, 5.0) is None
    assert binding_bounds(none, None, 0.01, 5.0) == ["perplexity", "retrieval"]
