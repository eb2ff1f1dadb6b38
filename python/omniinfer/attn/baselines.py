"""Baseline strategies the genetic algorithm is compared with, under the same budget.

Registry: ``BASELINES[name](objective, num_layers, rng)`` spends at most the objective's budget
and stops by raising or catching :class:`BudgetExhausted`; the caller reads the objective's
trials. Adding a baseline is adding a function here with ``@baseline("name")``.

The fixed families (first k, last k, every other layer) search their own count k: they
bisect for the largest k whose pattern keeps within the bound and measure its neighbours
(k - 1, k + 1), which is all a one-parameter family can offer; they may finish under budget.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from omniinfer.attn.objective import BudgetExhausted, Genome, Objective, from_layers

Strategy = Callable[[Objective, int, random.Random], None]
BASELINES: dict[str, Strategy] = {}


def baseline(name: str) -> Callable[[Strategy], Strategy]:
    def register(strategy: Strategy) -> Strategy:
        BASELINES[name] = strategy
        return strategy

    return register


@baseline("random")
def random_search(objective: Objective, num_layers: int, rng: random.Random) -> None:
    """Uniform count k, then a uniform set of k layers; repeated until the budget is spent."""
    try:
        for _ in range(100 * objective.budget):
            k = rng.randint(0, num_layers)
            objective.drop(from_layers(rng.sample(range(num_layers), k), num_layers))
    except BudgetExhausted:
        pass


def first_k(k: int, num_layers: int) -> Genome:
    return from_layers(range(k), num_layers)


def last_k(k: int, num_layers: int) -> Genome:
    return from_layers(range(num_layers - k, num_layers), num_layers)


def spread_k(k: int, num_layers: int) -> Genome:
    """k layers spaced evenly; k = L/2 is every other layer starting at layer 1 (layer 0,
    the one most models need whole, stays full)."""
    return from_layers({num_layers - 1 - (i * num_layers) // k for i in range(k)}, num_layers)


def family_search(objective: Objective, num_layers: int, family: Callable[[int, int], Genome]):
    """Bisect the largest feasible k of a one-parameter family, then try k - 1 and k + 1."""
    try:
        low, high = 0, num_layers  # invariant: k = low is feasible (no compression), high unknown
        while low < high:
            mid = (low + high + 1) // 2
            if objective.feasible(family(mid, num_layers)):
                low = mid
            else:
                high = mid - 1
        for k in (low - 1, low + 1):
            if 0 < k <= num_layers:
                objective.drop(family(k, num_layers))
    except BudgetExhausted:
        pass


@baseline("first-k")
def first_k_search(objective: Objective, num_layers: int, rng: random.Random) -> None:
    family_search(objective, num_layers, first_k)


@baseline("last-k")
def last_k_search(objective: Objective, num_layers: int, rng: random.Random) -> None:
    family_search(objective, num_layers, last_k)


@baseline("every-other")
def every_other_search(objective: Objective, num_layers: int, rng: random.Random) -> None:
    try:  # both phases of the plain every-other pattern first, then the evenly spread family
        objective.drop(tuple(i % 2 == 0 for i in range(num_layers)))
        objective.drop(tuple(i % 2 == 1 for i in range(num_layers)))
    except BudgetExhausted:
        return
    family_search(objective, num_layers, spread_k)


@baseline("greedy")
def greedy_search(objective: Objective, num_layers: int, rng: random.Random) -> None:
    """Layer by layer: measure each layer alone, then add layers from the least harmful on,
    keeping each addition that stays within the bound (one evaluation per addition)."""
    try:
        alone = {i: objective.drop(from_layers([i], num_layers)) for i in range(num_layers)}
        chosen: list[int] = []
        for layer in sorted(alone, key=lambda i: (alone[i], i)):
            if alone[layer] > objective.max_drop:
                break  # alone already over the bound: no set containing it is tried
            candidate = from_layers([*chosen, layer], num_layers)
            if objective.feasible(candidate):
                chosen.append(layer)
    except BudgetExhausted:
        pass
