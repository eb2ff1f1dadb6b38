"""A cheap model of the search's own measurements that proposes the next pattern to score.

Every evaluation of a candidate costs tens of seconds of model time, and a score from two windows
a text is noisy: the genetic algorithm's last generations mostly chase that noise. Yet the
patterns it has already scored say a lot together. Each layer's effect on a text's perplexity is
close to additive at a fixed number of compressed layers, so a ridge regression per text over
all scored patterns pools their windows, and its smallest predicted worst-text drop points at
a pattern the GA's random moves would take long to reach. The proposal is then measured like any
other candidate; nothing here decides the winner.

Pure NumPy: tested without a model.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from omniinfer.attn.objective import Genome


@dataclass(frozen=True)
class AdditiveModel:
    """Per-text drop ≈ intercept + Σ weight[layer] over compressed layers."""

    texts: tuple[str, ...]
    weights: np.ndarray  # (num_layers + 1, len(texts)); the last row is the intercept

    @property
    def num_layers(self) -> int:
        return self.weights.shape[0] - 1

    def predict(self, genome: Genome) -> dict[str, float]:
        x = np.append(np.asarray(genome, dtype=float), 1.0)
        return dict(zip(self.texts, (x @ self.weights).tolist(), strict=True))

    def worst(self, genome: Genome) -> float:
        return max(self.predict(genome).values())


def fit(scored: Sequence[tuple[Genome, Mapping[str, float]]], ridge: float = 0.3) -> AdditiveModel:
    """Fit on ``(pattern, {text: drop})`` pairs. The ridge term keeps layers the data rarely
    varies near zero rather than letting them take any value; the intercept is not penalised."""
    if not scored:
        raise ValueError("nothing scored to fit on")
    texts = tuple(sorted(scored[0][1]))
    lengths = {len(g) for g, _ in scored}
    if len(lengths) != 1:
        raise ValueError(f"patterns of different lengths: {sorted(lengths)}")
    if any(set(drops) != set(texts) for _, drops in scored):
        raise ValueError("every scored pattern needs a drop for the same texts")
    x = np.array([[*map(float, g), 1.0] for g, _ in scored])
    y = np.array([[drops[t] for t in texts] for _, drops in scored])
    penalty = ridge * np.eye(x.shape[1])
    penalty[-1, -1] = 0.0
    weights = np.linalg.solve(x.T @ x + penalty, x.T @ y)
    return AdditiveModel(texts, weights)


def _descend(model: AdditiveModel, start: set[int], n: int) -> frozenset[int]:
    """Swap one compressed layer for an uncompressed one while the predicted worst text drops."""
    chosen = set(start)
    current = model.worst(tuple(i in chosen for i in range(n)))
    improved = True
    while improved:
        improved = False
        for out in sorted(chosen):
            for into in range(n):
                if into in chosen:
                    continue
                trial = (chosen - {out}) | {into}
                value = model.worst(tuple(i in trial for i in range(n)))
                if value < current - 1e-12:
                    chosen, current, improved = trial, value, True
                    break
            if improved:
                break
    return frozenset(chosen)


def propose(model: AdditiveModel, size: int, avoid: Collection[Genome] = (),
            restarts: int = 32, seed: int = 0) -> Genome | None:
    """The pattern of ``size`` compressed layers with the smallest predicted worst-text drop
    that is not in ``avoid`` (already scored): local optima from random starts, then their
    one-swap neighbours, best first. ``None`` only when every candidate seen was avoided."""
    n = model.num_layers
    if not 0 < size <= n:
        raise ValueError(f"size {size} outside 1..{n}")
    rng = random.Random(seed)
    seen = set(avoid)
    optima = {_descend(model, set(rng.sample(range(n), size)), n) for _ in range(restarts)}
    candidates: set[frozenset[int]] = set(optima)
    for opt in optima:
        for out in opt:
            for into in set(range(n)) - opt:
                candidates.add((opt - {out}) | {into})
    ranked = sorted(candidates, key=lambda c: (model.worst(tuple(i in c for i in range(n))),
                                               sorted(c)))
    for chosen in ranked:
        genome = tuple(i in chosen for i in range(n))
        if genome not in seen:
            return genome
    return None


def propose_several(model: AdditiveModel, size: int, count: int,
                    avoid: Collection[Genome] = (), seed: int = 0) -> list[Genome]:
    """Up to ``count`` distinct proposals of ``size`` layers, none in ``avoid``, each the best
    predicted pattern not proposed before it (so the list is in predicted order). Used to seed a
    search at one context with what a search at another context measured."""
    proposals: list[Genome] = []
    for step in range(count):
        genome = propose(model, size, avoid=[*avoid, *proposals], seed=seed + step)
        if genome is None:
            break
        proposals.append(genome)
    return proposals
