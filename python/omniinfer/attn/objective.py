"""The search objective: most compressed layers whose accuracy drop stays within a bound.

Pure Python, shared by the genetic algorithm and every baseline so that they are judged alike:
each strategy gets its own :class:`Objective` with the same evaluation budget (distinct patterns
it asked for), while a shared cache lets strategies reuse a pattern another one already paid
for in wall time without changing anyone's budget.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, MutableMapping
from dataclasses import dataclass

Genome = tuple[bool, ...]


class BudgetExhausted(Exception):
    """The strategy asked for one more pattern than its budget (or time) allows."""


def to_bits(genome: Genome) -> str:
    return "".join("1" if g else "0" for g in genome)


def from_bits(bits: str) -> Genome:
    if set(bits) - {"0", "1"}:
        raise ValueError(f"not a bit string: {bits!r}")
    return tuple(c == "1" for c in bits)


def from_layers(layers: Iterable[int], num_layers: int) -> Genome:
    chosen = set(layers)
    return tuple(i in chosen for i in range(num_layers))


def rank_key(genome: Genome, drop: float, max_drop: float) -> tuple[int, float, float]:
    """Larger is better. Feasible beats infeasible; then more compressed layers, then a smaller
    drop; among infeasible patterns the smaller violation wins (Deb's constraint rules)."""
    if drop <= max_drop:
        return (1, float(sum(genome)), -drop)
    return (0, -(drop - max_drop), float(sum(genome)))


@dataclass(frozen=True)
class Trial:
    genome: Genome
    drop: float
    order: int  # 0-based position among this strategy's distinct evaluations


class Objective:
    """Budgeted, cached drop lookups for one strategy."""

    def __init__(
        self,
        evaluate: Callable[[Genome], float],
        max_drop: float,
        budget: int,
        shared_cache: MutableMapping[Genome, float] | None = None,
        deadline: float | None = None,
        on_trial: Callable[[Objective], None] | None = None,
    ) -> None:
        if budget < 1:
            raise ValueError("budget must be at least 1 evaluation")
        self._evaluate = evaluate
        self.max_drop = max_drop
        self.budget = budget
        self.cache: MutableMapping[Genome, float] = {} if shared_cache is None else shared_cache
        self.deadline = deadline  # time.monotonic() value after which no new pattern starts
        self.trials: dict[Genome, Trial] = {}
        self.on_trial = on_trial  # called after each newly charged evaluation (progress bars)

    @property
    def used(self) -> int:
        return len(self.trials)

    @property
    def remaining(self) -> int:
        return self.budget - self.used

    def drop(self, genome: Genome) -> float:
        genome = tuple(bool(g) for g in genome)
        if genome in self.trials:
            return self.trials[genome].drop
        if self.remaining <= 0:
            raise BudgetExhausted(f"budget of {self.budget} evaluations used")
        if genome not in self.cache:
            if self.deadline is not None and time.monotonic() >= self.deadline:
                raise BudgetExhausted("time limit reached")
            self.cache[genome] = float(self._evaluate(genome))
        value = self.cache[genome]
        self.trials[genome] = Trial(genome, value, self.used)
        if self.on_trial is not None:
            self.on_trial(self)
        return value

    def feasible(self, genome: Genome) -> bool:
        return self.drop(genome) <= self.max_drop

    def key(self, genome: Genome) -> tuple[int, float, float]:
        return rank_key(genome, self.drop(genome), self.max_drop)

    def best(self) -> Trial | None:
        """Best pattern asked for so far (feasible if any is), by :func:`rank_key`."""
        if not self.trials:
            return None
        return max(
            self.trials.values(), key=lambda t: (rank_key(t.genome, t.drop, self.max_drop), -t.order)
        )

    def restore(self, trials: Iterable[tuple[Genome, float]]) -> None:
        """Charge this strategy for evaluations it made before a checkpoint."""
        for genome, drop in trials:
            self.cache.setdefault(genome, drop)
            if genome not in self.trials:
                self.trials[genome] = Trial(genome, drop, self.used)
