"""Seeded genetic algorithm over per-layer compression bits (pure Python, no model).

Tournament selection on :func:`objective.rank_key`, uniform crossover, bit-flip mutation plus a
count-preserving swap move (moving one compressed layer elsewhere is the step that matters once
the search sits on the accuracy bound) and a directed step (grow the child of a feasible parent,
shrink that of an infeasible one), and elitism. Every generation boundary is written to a
JSON checkpoint holding the population, the random generator's state and the evaluations made,
so a resumed run continues exactly where the interrupted one stopped.

With ``layers`` set the search is of fixed size: every genome compresses exactly that many
layers (random genomes are drawn that size, children are repaired to it, the directed step is
off), so the objective's ranking reduces to the smaller drop. That is the question a KV budget
asks ("which k layers?"), and it keeps a noisy bound from deciding the size. ``seeds`` start
the first generation from known patterns (a baseline's best, say), the rest is random.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from omniinfer.attn.objective import BudgetExhausted, Genome, Objective, from_bits, to_bits

CHECKPOINT_FORMAT = "omniinfer.attn.ga-checkpoint/1"


@dataclass(frozen=True)
class GAConfig:
    population: int = 10
    generations: int = 40
    tournament: int = 3
    crossover_rate: float = 0.9
    mutation_rate: float | None = None  # per bit; None means 1 / number of layers
    swap_rate: float = 0.5
    step_rate: float = 0.5  # chance of one directed step: add a layer to a feasible parent's
    # child, remove one from an infeasible parent's child (the repair move of knapsack GAs)
    elitism: int = 2
    init_density: tuple[float, float] = (0.2, 0.6)
    seed: int = 0
    max_tries: int = 20  # attempts to breed a child not evaluated before
    patience: int = 5  # stop after this many generations that evaluated nothing new
    layers: int | None = None  # fixed number of compressed layers; None: the search sizes it
    seeds: tuple[str, ...] = ()  # bit strings placed in the first generation

    def __post_init__(self) -> None:
        if self.population < 2 or not 0 <= self.elitism < self.population:
            raise ValueError("need population >= 2 and 0 <= elitism < population")
        if self.tournament < 1:
            raise ValueError("tournament size must be >= 1")
        if len(self.seeds) > self.population:
            raise ValueError(f"{len(self.seeds)} seeds for a population of {self.population}")
        if self.layers is not None and self.layers < 1:
            raise ValueError("layers must be at least 1")


class GeneticSearch:
    """One GA run against an :class:`Objective`; ``run`` returns when generations or the
    objective's budget (or deadline) run out."""

    def __init__(
        self,
        num_layers: int,
        config: GAConfig,
        objective: Objective,
        checkpoint: Path | None = None,
        on_generation: Callable[[int, list[Genome]], None] | None = None,
    ) -> None:
        self.num_layers = num_layers
        self.config = config
        self.objective = objective
        self.checkpoint = checkpoint
        self.on_generation = on_generation
        self.rng = random.Random(config.seed)
        self.generation = -1
        self.population: list[Genome] = []
        self.boundary = 0  # evaluations made before the current generation was bred
        self.stopped_by_budget = False
        for bits in config.seeds:
            if len(bits) != num_layers or set(bits) - {"0", "1"}:
                raise ValueError(f"seed {bits!r} is not a {num_layers}-layer bit string")
            if config.layers is not None and bits.count("1") != config.layers:
                raise ValueError(f"seed {bits!r} does not compress {config.layers} layers")
        if config.layers is not None and config.layers > num_layers:
            raise ValueError(f"layers={config.layers} but the model has {num_layers}")
        if checkpoint is not None and checkpoint.exists():
            self._load(checkpoint)

    # -- operators -----------------------------------------------------------------------
    def _random_genome(self) -> Genome:
        if self.config.layers is not None:
            chosen = set(self.rng.sample(range(self.num_layers), self.config.layers))
            return tuple(i in chosen for i in range(self.num_layers))
        low, high = self.config.init_density
        density = self.rng.uniform(low, high)
        return tuple(self.rng.random() < density for _ in range(self.num_layers))

    def _first_generation(self) -> list[Genome]:
        seeds = [from_bits(bits) for bits in dict.fromkeys(self.config.seeds)]
        population = list(seeds)
        for _ in range(100 * self.config.population):
            if len(population) >= self.config.population:
                break
            genome = self._random_genome()
            if genome not in population:
                population.append(genome)
        return population

    def _repair(self, bits: list[bool]) -> list[bool]:
        """Fixed-size mode: switch random layers on or off until exactly ``layers`` are on."""
        target = self.config.layers
        if target is None:
            return bits
        on = [i for i, g in enumerate(bits) if g]
        off = [i for i, g in enumerate(bits) if not g]
        while len(on) > target:
            bits[on.pop(self.rng.randrange(len(on)))] = False
        while len(on) < target:
            i = off.pop(self.rng.randrange(len(off)))
            bits[i] = True
            on.append(i)
        return bits

    def _select(self) -> Genome:
        entrants = [self.rng.choice(self.population) for _ in range(self.config.tournament)]
        return max(entrants, key=self.objective.key)

    def _crossover(self, a: Genome, b: Genome) -> Genome:
        if self.rng.random() >= self.config.crossover_rate:
            return a
        return tuple(x if self.rng.random() < 0.5 else y for x, y in zip(a, b, strict=True))

    def _mutate(self, genome: Genome, grow: bool) -> Genome:
        rate = self.config.mutation_rate or 1.0 / self.num_layers
        bits = [not g if self.rng.random() < rate else g for g in genome]
        on = [i for i, g in enumerate(bits) if g]
        off = [i for i, g in enumerate(bits) if not g]
        if self.rng.random() < self.config.swap_rate and on and off:
            i, j = self.rng.choice(on), self.rng.choice(off)
            bits[i], bits[j] = False, True
        fixed = self.config.layers is not None
        if not fixed and self.rng.random() < self.config.step_rate and (off if grow else on):
            bits[self.rng.choice(off if grow else on)] = grow
        return tuple(self._repair(bits))

    def _breed(self, taken: set[Genome]) -> Genome:
        child: Genome = ()
        for _ in range(self.config.max_tries):
            first, second = self._select(), self._select()
            grow = self.objective.feasible(first)
            child = self._mutate(self._crossover(first, second), grow)
            if child not in taken:
                break
        return child

    # -- run -------------------------------------------------------------------------------
    def _evaluate_all(self, genomes: list[Genome]) -> None:
        for genome in genomes:
            self.objective.drop(genome)

    def _next_population(self) -> list[Genome]:
        ranked = sorted(self.population, key=self.objective.key, reverse=True)
        elite = list(dict.fromkeys(ranked))[: self.config.elitism]
        children: list[Genome] = []
        # Avoid patterns known at the generation boundary only, so that a resumed run, which
        # also knows the children evaluated before the interruption, breeds the same ones.
        known = [t.genome for t in self.objective.trials.values() if t.order < self.boundary]
        taken = set(elite) | set(known)
        while len(elite) + len(children) < self.config.population:
            child = self._breed(taken)
            taken.add(child)
            children.append(child)
        return elite + children

    def run(self) -> Objective:
        stale = 0
        while self.generation < self.config.generations and stale < self.config.patience:
            state, used = self.rng.getstate(), self.objective.used
            if self.generation < 0:
                population = self._first_generation()
            else:
                population = self._next_population()
            try:
                self._evaluate_all(population)
            except BudgetExhausted:
                self.rng.setstate(state)  # a resumed run breeds the same generation again
                self.stopped_by_budget = True
                self._save()
                break
            stale = 0 if self.objective.used > used else stale + 1
            self._advance(population)
        return self.objective

    def _advance(self, population: list[Genome]) -> None:
        self.population = population
        self.generation += 1
        self.boundary = self.objective.used
        self._save()
        if self.on_generation is not None:
            self.on_generation(self.generation, population)

    # -- checkpoint ------------------------------------------------------------------------
    def _save(self) -> None:
        if self.checkpoint is None:
            return
        version, internal, gauss = self.rng.getstate()
        trials = sorted(self.objective.trials.values(), key=lambda t: t.order)
        data = {
            "format": CHECKPOINT_FORMAT,
            "num_layers": self.num_layers,
            "config": asdict(self.config),
            "generation": self.generation,
            "boundary": self.boundary,
            "population": [to_bits(g) for g in self.population],
            "rng": [version, list(internal), gauss],
            "trials": [[to_bits(t.genome), t.drop] for t in trials],
        }
        self.checkpoint.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.checkpoint.with_suffix(".tmp")
        tmp.write_text(json.dumps(data), encoding="utf-8")
        tmp.replace(self.checkpoint)

    def _load(self, path: Path) -> None:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("format") != CHECKPOINT_FORMAT or data.get("num_layers") != self.num_layers:
            raise ValueError(f"{path}: not a GA checkpoint for {self.num_layers} layers")
        saved = {k: v for k, v in data["config"].items() if k != "generations"}
        mine = {k: v for k, v in asdict(self.config).items() if k != "generations"}
        saved["init_density"] = tuple(saved["init_density"])
        saved["seeds"] = tuple(saved.get("seeds", ()))
        saved.setdefault("layers", None)
        if saved != mine:
            raise ValueError(f"{path}: written with another GA configuration: {saved}")
        version, internal, gauss = data["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self.generation = data["generation"]
        self.boundary = data["boundary"]
        self.population = [from_bits(b) for b in data["population"]]
        self.objective.restore((from_bits(b), d) for b, d in data["trials"])
