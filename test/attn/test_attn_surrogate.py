"""The additive surrogate: fits what it is shown and proposes the unscored pattern it predicts best."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from omniinfer.attn import surrogate
from omniinfer.attn.objective import Genome, from_layers

N, SIZE = 10, 4
COST = {  # per-layer cost of compressing it, per text; "b" punishes what "a" likes
    "a": [0.1, 0.5, 0.2, 0.9, 0.3, 0.05, 0.7, 0.4, 0.6, 0.8],
    "b": [0.6, 0.1, 0.3, 0.2, 0.9, 0.5, 0.05, 0.8, 0.4, 0.7],
}


def drops(genome: Genome, noise: float = 0.0, rng: random.Random | None = None) -> dict[str, float]:
    return {t: sum(c for c, on in zip(cost, genome, strict=True) if on)
            + (rng.gauss(0, noise) if rng else 0.0) for t, cost in COST.items()}


def sample(count: int, seed: int = 0, noise: float = 0.0) -> list[tuple[Genome, dict[str, float]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        genome = from_layers(rng.sample(range(N), SIZE), N)
        out.append((genome, drops(genome, noise, rng)))
    return out


def true_best() -> Genome:
    combos = (from_layers(c, N) for c in itertools.combinations(range(N), SIZE))
    return min(combos, key=lambda g: max(drops(g).values()))


def test_fit_recovers_additive_costs_up_to_the_fixed_size_offset() -> None:
    model = surrogate.fit(sample(60), ridge=1e-6)
    for genome, truth in sample(20, seed=1):
        for text, value in model.predict(genome).items():
            assert value == pytest.approx(truth[text], abs=1e-6)


def test_proposal_is_the_best_worst_text_pattern_and_has_the_size() -> None:
    model = surrogate.fit(sample(60), ridge=1e-6)
    proposed = surrogate.propose(model, SIZE, restarts=16)
    assert proposed is not None and sum(proposed) == SIZE
    assert max(drops(proposed).values()) == pytest.approx(max(drops(true_best()).values()))


def test_proposal_skips_what_was_scored() -> None:
    model = surrogate.fit(sample(60), ridge=1e-6)
    best = surrogate.propose(model, SIZE)
    second = surrogate.propose(model, SIZE, avoid=[best])
    assert second is not None and second != best and sum(second) == SIZE
    assert model.worst(second) >= model.worst(best)


def test_proposal_beats_the_scored_patterns_when_scores_are_noisy() -> None:
    scored = sample(40, noise=0.05)
    model = surrogate.fit(scored, ridge=0.3)
    proposed = surrogate.propose(model, SIZE, avoid=[g for g, _ in scored])
    assert proposed is not None
    best_scored = min(max(drops(g).values()) for g, _ in scored)
    assert max(drops(proposed).values()) <= best_scored + 1e-9


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="nothing scored"):
        surrogate.fit([])
    with pytest.raises(ValueError, match="different lengths"):
        surrogate.fit([((True, False), {"a": 0.1}), ((True,), {"a": 0.2})])
    with pytest.raises(ValueError, match="same texts"):
        surrogate.fit([((True, False), {"a": 0.1}), ((False, True), {"b": 0.2})])
    model = surrogate.fit(sample(30))
    with pytest.raises(ValueError, match="size"):
        surrogate.propose(model, N + 1)
    assert isinstance(model.weights, np.ndarray)


def test_several_proposals_are_distinct_sized_and_in_predicted_order() -> None:
    model = surrogate.fit(sample(60), ridge=1e-6)
    proposals = surrogate.propose_several(model, SIZE, 5)
    assert len(proposals) == 5 and len(set(proposals)) == 5
    assert all(sum(g) == SIZE for g in proposals)
    predicted = [model.worst(g) for g in proposals]
    assert predicted == sorted(predicted)
    assert proposals[0] == surrogate.propose(model, SIZE)
    # A larger size than the fit saw: the layers it found cheap are the ones added.
    wider = surrogate.propose_several(model, SIZE + 2, 1)[0]
    assert max(drops(wider).values()) == pytest.approx(min(
        max(drops(from_layers(c, N)).values())
        for c in itertools.combinations(range(N), SIZE + 2)))
