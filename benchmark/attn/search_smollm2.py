"""OmniAttn pattern search on SmolLM2-135M at 2K context: the GA against every baseline.

Each method gets the same budget of distinct pattern evaluations on the search half of
Paradise Lost; the best pattern each one finds within the accuracy bound is then scored on
held-out windows of the other half. Prints a table, writes ``results.json`` and
``tradeoff.png`` (accuracy drop vs KV saved) into ``--out``; with ``--write-pattern`` also the
GA's pattern file. Evaluations are cached in ``--out/run/``: a rerun resumes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from omniinfer.attn import evaluator, text
from omniinfer.attn.ga import GAConfig
from omniinfer.attn.objective import from_bits
from omniinfer.attn.pattern import from_layers
from omniinfer.attn.search import GA, SearchSettings, pareto_front, run_search, summary

HERE = Path(__file__).resolve().parent
METHODS = (GA, "greedy", "random", "first-k", "last-k", "every-other")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", type=Path, default=evaluator.DEFAULT_MODEL)
    p.add_argument("--text", default="paradise_lost")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--sink", type=int, default=128)
    p.add_argument("--recent", type=int, default=384)
    p.add_argument("--max-drop", type=float, default=0.01)
    p.add_argument("--budget", type=int, default=24, help="distinct evaluations per method")
    p.add_argument("--search-windows", type=int, default=1)
    p.add_argument("--heldout-windows", type=int, default=2)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--population", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-limit", type=float, default=None, help="minutes per method")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--write-pattern", type=Path, default=None)
    return p.parse_args(argv)


class HeldOut:
    """Held-out scores of patterns, computed once each and kept in ``run/heldout.json``."""

    def __init__(self, model: Any, windows: list[list[int]], args: argparse.Namespace) -> None:
        self.model, self.windows, self.args = model, windows, args
        self.path = args.out / "run" / "heldout.json"
        self.scores: dict[str, Any] = (
            json.loads(self.path.read_text()) if self.path.exists() else {}
        )
        self.evaluator: evaluator.Evaluator | None = None

    def score(self, bits: str) -> dict[str, Any]:
        if bits not in self.scores:
            if self.evaluator is None:
                self.evaluator = evaluator.Evaluator(
                    self.model, self.windows, self.args.sink, self.args.recent
                )
            metrics = self.evaluator.evaluate(from_bits(bits)).to_json()
            metrics["kv_saved_fraction"] = self.evaluator.kv_saved_fraction(
                from_bits(bits), self.args.context
            )
            self.scores[bits] = metrics
            self.path.write_text(json.dumps(self.scores, indent=0))
        return self.scores[bits]


def table(results: dict[str, Any], heldout: dict[str, Any]) -> str:
    lines = [f"{'method':<12} {'evals':>5} {'layers':>6} {'KV saved':>8} {'search':>8} "
             f"{'held-out':>9} {'±':>5} {'agree':>6}"]
    for name, record in results.items():
        bits = record["best"]
        if bits is None:
            lines.append(f"{name:<12} {record['evaluations']:>5}   none within the bound")
            continue
        trial = next(t for t in record["trials"] if t["pattern"] == bits)
        h = heldout[bits]
        lines.append(
            f"{name:<12} {record['evaluations']:>5} {bits.count('1'):>6} "
            f"{trial['kv_saved_fraction'] * 100:>7.1f}% {trial['drop'] * 100:>+7.2f}% "
            f"{h['drop'] * 100:>+8.2f}% {h['drop_stderr'] * 100:>5.2f} {h['agreement']:>6.3f}"
        )
    return "\n".join(lines)


def plot(results: dict[str, Any], heldout: dict[str, Any], args: argparse.Namespace) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (name, record) in enumerate(results.items()):
        color = f"C{i}"
        saved = [t["kv_saved_fraction"] * 100 for t in record["trials"]]
        drops = [t["drop"] * 100 for t in record["trials"]]
        ax.scatter(saved, drops, s=10, alpha=0.35, color=color)
        front = pareto_front(record["trials"])
        ax.plot(
            [t["kv_saved_fraction"] * 100 for t in front],
            [t["drop"] * 100 for t in front],
            marker="o", ms=3, color=color, label=f"{name} ({record['evaluations']} evals)",
        )
        if record["best"] in heldout:
            h = heldout[record["best"]]
            ax.scatter([h["kv_saved_fraction"] * 100], [h["drop"] * 100], marker="*", s=140,
                       color=color, edgecolors="black", zorder=5)
    ax.axhline(args.max_drop * 100, color="grey", ls="--", lw=1, label="bound (search)")
    ax.axvline(40, color="grey", ls=":", lw=1)
    ax.set_xlabel(f"KV saved at {args.context} tokens (%)")
    ax.set_ylabel("relative perplexity increase (%)")
    ax.set_title(
        f"SmolLM2-135M, sink {args.sink} + recent {args.recent}: search half (dots, fronts), "
        "held-out (stars)", fontsize=9,
    )
    ax.set_ylim(bottom=min(-0.5, ax.get_ylim()[0]))
    ax.legend(fontsize=8)
    path = args.out / "tradeoff.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = evaluator.load_model(args.model)
    book = text.read(args.text)
    search_windows = text.windows(
        tokenizer, text.part(book, "search"), args.context, args.search_windows
    )
    heldout_windows = text.windows(
        tokenizer, text.part(book, "heldout"), args.context, args.heldout_windows
    )
    began = time.perf_counter()
    ev = evaluator.Evaluator(model, search_windows, args.sink, args.recent)
    reference_s = time.perf_counter() - began
    num_layers = ev.num_layers
    seconds: list[float] = []

    def evaluate(genome: tuple[bool, ...]) -> dict[str, Any]:
        metrics = ev.evaluate(genome).to_json()
        seconds.append(metrics["seconds"])
        metrics["kv_saved_fraction"] = ev.kv_saved_fraction(genome, args.context)
        return metrics

    methods = tuple(m for m in args.methods.split(",") if m)
    settings = SearchSettings(
        max_drop=args.max_drop,
        budget=args.budget,
        methods=methods,
        ga=GAConfig(population=args.population, generations=10_000, seed=args.seed),
        time_limit_s=None if args.time_limit is None else args.time_limit * 60,
    )
    held = HeldOut(model, heldout_windows, args)
    results: dict[str, Any] = {}
    for method in methods:  # one at a time: every artifact is rewritten after each method
        one = replace(settings, methods=(method,))
        results |= summary(run_search(evaluate, num_layers, one, args.out / "run"))
        if results[method]["best"]:
            held.score(results[method]["best"])
        write_outputs(args, argv, ev, results, held.scores, seconds, reference_s)
        print("\n" + table(results, held.scores), flush=True)
        if method == GA and args.write_pattern and results[GA]["best"]:
            write_pattern(args, model, results[GA], held.scores[results[GA]["best"]])
    return 0


def write_outputs(
    args: argparse.Namespace,
    argv: list[str] | None,
    ev: evaluator.Evaluator,
    results: dict[str, Any],
    heldout: dict[str, Any],
    seconds: list[float],
    reference_s: float,
) -> None:
    output = {
        "model": str(args.model.name),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                     if k not in ("out", "write_pattern", "model")},
        "search_tokens": sum(r.nll.numel() for r in ev.reference),
        "ppl_full_search": summary_ppl(ev),
        "reference_seconds": reference_s,
        "evaluation_seconds": {
            "count": len(seconds),
            "mean": statistics.fmean(seconds) if seconds else None,
            "stdev": statistics.stdev(seconds) if len(seconds) > 1 else None,
        },
        "methods": results,
        "heldout": {"windows": args.heldout_windows, "patterns": heldout},
        "command": "python " + " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
    }
    (args.out / "results.json").write_text(json.dumps(output, indent=1) + "\n")
    plot(results, heldout, args)


def summary_ppl(ev: evaluator.Evaluator) -> float:
    return evaluator.compare(ev.reference, ev.reference)["ppl_full"]


def write_pattern(args: argparse.Namespace, model: Any, ga: dict[str, Any], h: dict) -> None:
    trial = next(t for t in ga["trials"] if t["pattern"] == ga["best"])
    provenance = {
        "method": "genetic algorithm (omniinfer.attn.ga)",
        "objective": f"most compressed layers with relative perplexity increase <= {args.max_drop}",
        "search_data": f"{args.text}, search half, {args.search_windows} x {args.context} tokens",
        "search_drop": trial["drop"],
        "heldout_data": f"{args.text}, held-out half, {args.heldout_windows} x {args.context}",
        "heldout_drop": h["drop"],
        "heldout_agreement": h["agreement"],
        "kv_saved_fraction": h["kv_saved_fraction"],
        "context": args.context,
        "seed": args.seed,
        "budget": args.budget,
        "evaluations": ga["evaluations"],
        "population": args.population,
    }
    pattern = from_layers(
        ga["best_layers"], model.config, args.sink, args.recent, args.model.name, provenance
    )
    pattern.save(args.write_pattern)
    print(f"wrote {args.write_pattern}")


if __name__ == "__main__":
    raise SystemExit(main())
