"""The genetic algorithm and the baselines on a synthetic objective (no model involved)."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest

from omniinfer.attn import baselines
from omniinfer.attn.ga import GAConfig, GeneticSearch
from omniinfer.attn.objective import BudgetExhausted, Genome, Objective, from_layers, rank_key

LAYERS = 12
# Early layers are cheap to compress, late ones dear, with a few exceptions (like real models).
WEIGHTS = [0.05, 0.4, 0.08, 0.12, 0.02, 0.3, 0.07, 0.5, 0.09, 0.6, 0.04, 0.8]
BOUND = 0.35


def synthetic_drop(genome: Genome) -> float:
    """Superadditive: each compressed layer also makes the others hurt more."""
    base = sum(w for w, g in zip(WEIGHTS, genome, strict=True) if g)
    return base * (1 + 0.05 * sum(genome))


def optimum() -> int:
    return max(
        sum(g) for g in itertools.product((False, True), repeat=LAYERS)
        if synthetic_drop(g) <= BOUND
    )


class Counter:
    def __init__(self) -> None:
        self.calls: list[Genome] = []

    def __call__(self, genome: Genome) -> float:
        self.calls.append(genome)
        return synthetic_drop(genome)


def _ga(budget: int, seed: int = 0, checkpoint: Path | None = None, **config: object):
    counter = Counter()
    objective = Objective(counter, BOUND, budget)
    search = GeneticSearch(LAYERS, GAConfig(population=8, seed=seed, **config), objective,
                           checkpoint)
    search.run()
    return search, objective, counter


def _history(objective: Objective) -> list[tuple[Genome, float]]:
    return [(t.genome, t.drop) for t in sorted(objective.trials.values(), key=lambda t: t.order)]


def test_ga_gets_near_the_optimum_and_beats_random_search() -> None:
    for seed in range(3):
        _, objective, counter = _ga(budget=80, seed=seed)
        best = objective.best()
        assert best is not None and best.drop <= BOUND
        assert sum(best.genome) >= optimum() - 1 == 4
        assert objective.used == len(counter.calls) <= 80
        assert len(set(counter.calls)) == len(counter.calls)  # fitness cache: never twice
        rival = Objective(synthetic_drop, BOUND, 80)
        baselines.BASELINES["random"](rival, LAYERS, random.Random(seed))
        assert sum(best.genome) >= sum(rival.best().genome)  # type: ignore[union-attr]


def test_ga_is_deterministic_for_a_seed_and_varies_across_seeds() -> None:
    first, second, other = _ga(40)[1], _ga(40)[1], _ga(40, seed=1)[1]
    assert _history(first) == _history(second)
    assert _history(first) != _history(other)


@pytest.mark.parametrize("stop_at", [5, 20, 33])
def test_resume_from_checkpoint_equals_an_uninterrupted_run(tmp_path: Path, stop_at: int) -> None:
    checkpoint = tmp_path / "ga.json"
    _, _, first_calls = _ga(stop_at, checkpoint=checkpoint)
    assert checkpoint.exists()
    search, resumed, second_calls = _ga(50, checkpoint=checkpoint)
    _, straight, _ = _ga(50)
    assert _history(resumed) == _history(straight)
    assert resumed.used == 50 and search.stopped_by_budget
    # Evaluations made before the interruption were not repeated.
    assert not set(first_calls.calls) & set(second_calls.calls)


def test_resume_refuses_another_configuration(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ga.json"
    _ga(10, checkpoint=checkpoint)
    with pytest.raises(ValueError, match="another GA configuration"):
        _ga(20, checkpoint=checkpoint, tournament=2)


def test_ga_stops_when_nothing_new_can_be_bred() -> None:
    counter = Counter()
    objective = Objective(counter, BOUND, budget=1000)
    search = GeneticSearch(3, GAConfig(population=4, generations=10_000), objective)
    counter_drop = objective._evaluate
    objective._evaluate = lambda g: counter_drop((*g, *([False] * (LAYERS - 3))))
    search.run()
    assert objective.used <= 8 and search.generation < 100


def test_objective_budget_shared_cache_and_ranking() -> None:
    shared: dict[Genome, float] = {}
    counter = Counter()
    a = Objective(counter, BOUND, budget=2, shared_cache=shared)
    b = Objective(counter, BOUND, budget=2, shared_cache=shared)
    g1, g2, g3 = from_layers([0], LAYERS), from_layers([1], LAYERS), from_layers([2], LAYERS)
    a.drop(g1), a.drop(g2), a.drop(g1)
    with pytest.raises(BudgetExhausted):
        a.drop(g3)
    b.drop(g1)  # charged to b's budget, but not evaluated again
    assert len(counter.calls) == 2 and b.used == 1
    feasible_few = rank_key(from_layers([0], LAYERS), 0.01, BOUND)
    feasible_many = rank_key(from_layers([0, 1], LAYERS), 0.3, BOUND)
    infeasible = rank_key(from_layers([0, 1, 2], LAYERS), 0.5, BOUND)
    assert feasible_many > feasible_few > infeasible


def test_baselines_are_registered_and_respect_the_budget() -> None:
    assert set(baselines.BASELINES) == {"random", "first-k", "last-k", "every-other", "greedy"}
    for name, strategy in baselines.BASELINES.items():
        objective = Objective(synthetic_drop, BOUND, budget=9)
        strategy(objective, LAYERS, random.Random(0))
        assert 0 < objective.used <= 9, name


def test_first_k_bisects_to_the_largest_feasible_count() -> None:
    objective = Objective(synthetic_drop, BOUND, budget=30)
    baselines.BASELINES["first-k"](objective, LAYERS, random.Random(0))
    best = objective.best()
    assert best is not None and best.genome == baselines.first_k(1, LAYERS)
    assert synthetic_drop(baselines.first_k(2, LAYERS)) > BOUND
    assert objective.used <= 7


def test_greedy_adds_the_least_harmful_layers_first() -> None:
    objective = Objective(synthetic_drop, BOUND, budget=100)
    baselines.BASELINES["greedy"](objective, LAYERS, random.Random(0))
    best = objective.best()
    assert best is not None and best.genome == from_layers([4, 10, 0, 6, 2], LAYERS)


def test_spread_family_is_every_other_layer_at_half() -> None:
    assert baselines.spread_k(6, LAYERS) == tuple(i % 2 == 1 for i in range(LAYERS))
    assert sum(baselines.spread_k(5, LAYERS)) == 5


def _best_k_set(k: int) -> Genome:
    return min(
        (from_layers(c, LAYERS) for c in itertools.combinations(range(LAYERS), k)),
        key=synthetic_drop,
    )


def test_fixed_size_search_only_asks_for_that_size_and_finds_the_best_set() -> None:
    k = 5
    found = 0
    for seed in range(3):
        _, objective, counter = _ga(budget=60, seed=seed, layers=k)
        assert counter.calls and all(sum(g) == k for g in counter.calls)
        best = objective.best()
        assert best is not None and sum(best.genome) == k
        found += best.genome == _best_k_set(k)
    assert found >= 2  # 792 sets of 5; the GA sees at most 60


def test_seeds_start_the_first_generation() -> None:
    seed_bits = "".join("1" if i < 5 else "0" for i in range(LAYERS))
    _, objective, counter = _ga(budget=8, layers=5, seeds=(seed_bits,))
    assert counter.calls[0] == from_layers(range(5), LAYERS)
    with pytest.raises(ValueError, match="does not compress 4"):
        GeneticSearch(LAYERS, GAConfig(population=8, layers=4, seeds=(seed_bits,)),
                      Objective(synthetic_drop, BOUND, 4))
    with pytest.raises(ValueError, match="not a 12-layer bit string"):
        GeneticSearch(LAYERS, GAConfig(population=8, seeds=("101",)),
                      Objective(synthetic_drop, BOUND, 4))
