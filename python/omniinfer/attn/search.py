"""One search run: the GA and the chosen baselines, each with the same evaluation budget.

Model I/O stays outside: the run receives ``evaluate(genome) -> dict`` (at least ``drop``;
the evaluator also gives perplexities and agreement) and the number of layers. Every
evaluation lands in a JSON cache in the run folder, so an interrupted run resumes without
repeating forward passes, and the GA also keeps its own checkpoint there.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from omniinfer.attn.baselines import BASELINES
from omniinfer.attn.ga import GAConfig, GeneticSearch
from omniinfer.attn.objective import Genome, Objective, from_bits, to_bits

GA = "ga"
Evaluate = Callable[[Genome], dict[str, Any]]


@dataclass(frozen=True)
class SearchSettings:
    """``key`` names the figure of an evaluation that the bound ``max_drop`` applies to: the
    perplexity increase (``drop``), or a figure that folds several bounds into that scale
    (``constraint``, :func:`omniinfer.attn.retrieval.constraint`)."""

    max_drop: float = 0.01
    budget: int = 60  # distinct patterns each strategy may evaluate
    methods: tuple[str, ...] = (GA,)
    ga: GAConfig = field(default_factory=GAConfig)
    time_limit_s: float | None = None  # per strategy; None: budget only
    key: str = "drop"

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m != GA and m not in BASELINES]
        if unknown:
            raise ValueError(f"unknown methods {unknown}; choose from {[GA, *BASELINES]}")


@dataclass
class MethodResult:
    method: str
    evaluations: int
    seconds: float
    stopped_by: str  # "done", "budget" or "time"
    best: str | None  # bit string of the best feasible pattern (None if none is)
    trials: list[dict[str, Any]]


class MetricsCache:
    """Evaluations keyed by pattern bits, optionally mirrored to a JSON file. A record read back
    without ``required`` (a run resumed with another objective) is evaluated again."""

    def __init__(self, evaluate: Evaluate, path: Path | None = None,
                 required: str = "drop") -> None:
        self.evaluate = evaluate
        self.path = path
        self.required = required
        self.records: dict[str, dict[str, Any]] = {}
        if path is not None and path.exists():
            self.records = json.loads(path.read_text(encoding="utf-8"))

    def get(self, genome: Genome) -> dict[str, Any]:
        bits = to_bits(genome)
        if self.required not in self.records.get(bits, {}):
            self.records[bits] = dict(self.evaluate(genome))
            self._write()
        return self.records[bits]

    def _write(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.records, indent=0), encoding="utf-8")
        tmp.replace(self.path)


def _progress(total: int, label: str, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=label, unit="eval", disable=not enabled, leave=True)


def run_method(
    method: str,
    cache: MetricsCache,
    num_layers: int,
    settings: SearchSettings,
    run_dir: Path | None,
    progress: bool,
) -> MethodResult:
    bar = _progress(settings.budget, method, progress)

    def drop_of(genome: Genome) -> float:
        record = cache.get(genome)
        return float(record[settings.key])

    def advance(objective: Objective) -> None:
        bar.update(1)
        bar.set_postfix_str(_describe(objective))

    deadline = None if settings.time_limit_s is None else time.monotonic() + settings.time_limit_s
    objective = Objective(
        drop_of, settings.max_drop, settings.budget, deadline=deadline, on_trial=advance
    )
    began = time.perf_counter()
    if method == GA:
        checkpoint = None if run_dir is None else run_dir / "ga-checkpoint.json"
        ga = GeneticSearch(num_layers, settings.ga, objective, checkpoint)
        bar.update(objective.used - bar.n)
        ga.run()
    else:
        BASELINES[method](objective, num_layers, random.Random(settings.ga.seed))
    bar.close()
    timed_out = deadline is not None and time.monotonic() >= deadline
    stopped = "time" if timed_out else "budget" if objective.remaining <= 0 else "done"
    best = objective.best()
    feasible = best is not None and best.drop <= settings.max_drop
    trials = [
        {"pattern": to_bits(t.genome), "order": t.order, **cache.get(t.genome)}
        for t in sorted(objective.trials.values(), key=lambda t: t.order)
    ]
    return MethodResult(
        method=method,
        evaluations=objective.used,
        seconds=time.perf_counter() - began,
        stopped_by=stopped,
        best=to_bits(best.genome) if feasible and best else None,
        trials=trials,
    )


def _describe(objective: Objective) -> str:
    best = objective.best()
    if best is None:
        return "-"
    return f"{sum(best.genome)}L/{best.drop * 100:+.2f}%"


def run_search(
    evaluate: Evaluate,
    num_layers: int,
    settings: SearchSettings,
    run_dir: Path | None = None,
    progress: bool = True,
) -> dict[str, MethodResult]:
    """Run every method of ``settings`` in order; returns their results by name."""
    cache = MetricsCache(evaluate, None if run_dir is None else run_dir / "evaluations.json",
                         settings.key)
    return {
        method: run_method(method, cache, num_layers, settings, run_dir, progress)
        for method in settings.methods
    }


def best_of(result: MethodResult) -> Genome | None:
    return None if result.best is None else from_bits(result.best)


def pareto_front(trials: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Trials no other trial beats on both compressed layers (more) and drop (lower)."""
    ordered = sorted(trials, key=lambda t: (-t["pattern"].count("1"), t["drop"]))
    front: list[dict[str, Any]] = []
    for trial in ordered:
        if not front or trial["drop"] < front[-1]["drop"]:
            front.append(trial)
    return front


def summary(results: dict[str, MethodResult]) -> dict[str, Any]:
    """JSON-ready results per method, with the best pattern's layer ids spelled out."""
    out: dict[str, Any] = {}
    for name, result in results.items():
        best = best_of(result)
        record = asdict(result)
        record["best_layers"] = None if best is None else [i for i, b in enumerate(best) if b]
        out[name] = record
    return out
