"""OmniAttn pattern search that generalises: several texts of several kinds, judged on unseen ones.

A pattern scored on one window of one text overfits it (a 2K window's standard error is about
as large as a 1 % bound). Here the GA scores each candidate on windows from the search halves of
several texts of different kinds and keeps the worst text's perplexity increase as the
objective, at a fixed number of compressed layers (the KV budget). The winner is then reported
on texts the search never touched, against the first-k family at every size around it, on the
held-out halves of the search texts, and at longer contexts (4K, 8K). Prints tables, writes
``results.json`` and ``generalise.png`` into ``--out``; every evaluation is cached in
``--out/run/`` so a rerun resumes.

    python benchmark/attn/generalise.py --write-pattern python/omniinfer/attn/patterns/smollm2-135m.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from omniinfer.attn import evaluator, surrogate, text
from omniinfer.attn.baselines import first_k
from omniinfer.attn.ga import GAConfig
from omniinfer.attn.objective import Genome, from_bits, from_layers, to_bits
from omniinfer.attn.pattern import from_layers as pattern_from_layers
from omniinfer.attn.pattern import kv_saved_fraction
from omniinfer.attn.pattern import load as load_pattern
from omniinfer.attn.search import GA, MetricsCache, SearchSettings, run_search, summary

HERE = Path(__file__).resolve().parent
# The uncompressed model's scores per window set, kept between runs (not part of the results).
REFERENCE_DIR = HERE.parents[1] / ".cache" / "attn-reference"
SEARCH_TEXTS = "paradise_lost,tinyshakespeare,lcet10,sqlite3_h"  # verse, drama, report, code
UNSEEN_TEXTS = "alice,asyoulik,stb_truetype_h"  # novel, another play, another C header


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, default=evaluator.DEFAULT_MODEL)
    p.add_argument("--search-texts", default=SEARCH_TEXTS)
    p.add_argument("--unseen-texts", default=UNSEEN_TEXTS,
                   help="texts the search never reads; the pattern is judged on them")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--sink", type=int, default=128)
    p.add_argument("--recent", type=int, default=384)
    p.add_argument("--layers", type=int, default=16,
                   help="compressed layers (16 of 30 saves 40 %% of KV at 2K with 128 + 384)")
    p.add_argument("--max-drop", type=float, default=0.01, help="the bound reported against")
    p.add_argument("--search-windows", type=int, default=2, help="per search text")
    p.add_argument("--unseen-windows", type=int, default=5, help="per unseen text")
    p.add_argument("--heldout-windows", type=int, default=2,
                   help="per search text, from its held-out half")
    p.add_argument("--budget", type=int, default=48, help="distinct patterns the GA evaluates")
    p.add_argument("--population", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--refine", type=int, default=12,
                   help="patterns proposed by an additive model of the GA's scores, after it")
    p.add_argument("--ridge", type=float, default=0.3, help="the additive model's ridge term")
    p.add_argument("--first-k", default="12,13,14,15,16,17,18",
                   help="first-k sizes reported beside the GA's pattern")
    p.add_argument("--transfer", type=Path, default=None,
                   help="a search's score cache at another context or window (its run/search-"
                        "*.json, same search texts): an additive model fitted on it proposes "
                        "--transfer-seeds patterns of --layers for the GA's first generation")
    p.add_argument("--transfer-seeds", type=int, default=3)
    p.add_argument("--seed-patterns", default="",
                   help="pattern files (comma list) whose layers join the GA's first generation, "
                        "e.g. the pattern shipped before; each must compress --layers layers")
    p.add_argument("--previous", type=Path, default=None,
                   help="a pattern file to report as well (e.g. the one shipped before)")
    p.add_argument("--long", default="4096:3,8192:2",
                   help="CONTEXT:WINDOWS per unseen text for the long-context check ('' skips)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads (0: torch's default); 1 is far faster than 2 when "
                        "another job holds a core, since the threads wait for each other")
    p.add_argument("--long-patterns", default="ga",
                   help="which of the reported patterns get the long-context check")
    p.add_argument("--reference-dir", type=Path, default=REFERENCE_DIR,
                   help="where the uncompressed model's scores per window set are kept")
    p.add_argument("--out", type=Path, default=HERE / "results" / "generalise")
    p.add_argument("--write-pattern", type=Path, default=None)
    return p.parse_args(argv)


def lazy_scores(path: Path, build: Any) -> MetricsCache:
    """Scores of patterns on one set of windows, each computed once and kept in ``path``; the
    evaluator (its reference pass included) is built only when a pattern is not cached yet."""
    built: list[evaluator.TextSetEvaluator] = []

    def evaluate(genome: Genome) -> dict[str, Any]:
        if not built:
            built.append(build())
        record = built[0].evaluate(genome)
        record["kv_saved_fraction"] = built[0].kv_saved_fraction(genome, built[0].context)
        return record

    return MetricsCache(evaluate, path)


def refine(search: MetricsCache, scored: list[Genome], args: argparse.Namespace) -> list[dict]:
    """``--refine`` rounds: fit the additive model on the GA's patterns and the proposals so
    far, score its best unscored pattern, repeat. Fitting only on those (not on whatever else
    the cache holds) makes a rerun propose the same patterns, so it resumes from the cache."""
    proposals: list[dict] = []
    pool = [g for g in dict.fromkeys(scored) if sum(g) == args.layers]
    for step in tqdm(range(args.refine), desc="surrogate proposals", unit="eval"):
        drops = [(g, {n: m["drop"] for n, m in search.get(g)["texts"].items()}) for g in pool]
        model = surrogate.fit(drops, args.ridge)
        genome = surrogate.propose(model, args.layers, avoid=pool, seed=args.seed + step)
        if genome is None:
            break
        record = search.get(genome)
        proposals.append({"pattern": to_bits(genome), "predicted_drop": model.worst(genome),
                          "drop": record["drop"], "worst_text": record["worst_text"]})
        pool.append(genome)
    return proposals


def transfer_seeds(cache: Path, texts: list[str], size: int, count: int, ridge: float,
                   seed: int) -> list[str]:
    """Bit strings of ``count`` patterns of ``size`` layers that the additive model fitted on
    another search's scores (``cache``) predicts best; the texts must be the ones searched here."""
    records = json.loads(cache.read_text(encoding="utf-8"))
    scored = [(from_bits(bits), {n: m["drop"] for n, m in record["texts"].items()})
              for bits, record in records.items()]
    if not scored or set(scored[0][1]) != set(texts):
        raise SystemExit(f"{cache} does not hold scores on the search texts {texts}")
    model = surrogate.fit(scored, ridge)
    return [to_bits(g) for g in surrogate.propose_several(model, size, count, seed=seed)]


def pattern_seeds(spec: str, size: int, num_layers: int) -> list[str]:
    """Bit strings of the pattern files in ``spec`` (comma list), each of ``size`` layers."""
    seeds = []
    for path in (Path(p) for p in spec.split(",") if p):
        layers = load_pattern(path).compressed_layers
        if len(layers) != size:
            raise SystemExit(f"{path}: compresses {len(layers)} layers; the search holds {size}")
        seeds.append(to_bits(from_layers(layers, num_layers)))
    return seeds


def names(spec: str) -> list[str]:
    out = [n for n in spec.split(",") if n]
    unknown = [n for n in out if n not in text.SHIPPED]
    if unknown:
        raise SystemExit(f"unknown texts {unknown}; shipped: {sorted(text.SHIPPED)}")
    return out


def windows_of(tokenizer: Any, texts: list[str], which: str, context: int, count: int) -> dict:
    return {n: text.windows(tokenizer, text.part(text.read(n), which), context, count)
            for n in texts}


def row(label: str, genome: Genome, record: dict[str, Any], texts: list[str]) -> str:
    cells = "".join(
        f" {record['texts'][n]['drop'] * 100:>+6.2f}±{record['texts'][n]['drop_stderr'] * 100:.2f}"
        for n in texts
    )
    return (f"{label:<14} {sum(genome):>3} {record['kv_saved_fraction'] * 100:>6.1f}%"
            f"{cells}  worst {record['drop'] * 100:+.2f}%")


def header(texts: list[str]) -> str:
    return f"{'pattern':<14} {'L':>3} {'KV sav':>7}" + "".join(f" {n[:11]:>11}" for n in texts)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    search_texts, unseen_texts = names(args.search_texts), names(args.unseen_texts)
    if set(search_texts) & set(unseen_texts):
        raise SystemExit("a text cannot be both searched on and unseen")
    args.out.mkdir(parents=True, exist_ok=True)
    run = args.out / "run"
    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)
    model, tokenizer = evaluator.load_model(args.model)
    num_layers = int(model.config.num_hidden_layers)

    def evaluator_for(texts: list[str], which: str, context: int, count: int) -> Any:
        return lambda: evaluator.TextSetEvaluator(
            model, windows_of(tokenizer, texts, which, context, count), args.sink, args.recent,
            args.reference_dir,
        )

    def scores(texts: list[str], which: str, context: int, count: int) -> MetricsCache:
        # Everything a score depends on names its cache file, so no run reads another's scores.
        texts_id = hashlib.sha1(",".join(texts).encode()).hexdigest()[:6]
        path = run / (f"{which}-{texts_id}-{count}x{context}-"
                      f"sink{args.sink}-recent{args.recent}.json")
        return lazy_scores(path, evaluator_for(texts, which, context, count))

    search = scores(search_texts, "search", args.context, args.search_windows)
    unseen = scores(unseen_texts, "all", args.context, args.unseen_windows)
    heldout = scores(search_texts, "heldout", args.context, args.heldout_windows)

    # 1. The GA at a fixed size, seeded with the first-k pattern of that size.
    began = time.perf_counter()
    seed_bits = [to_bits(first_k(args.layers, num_layers))]
    if args.transfer is not None:
        seed_bits += transfer_seeds(args.transfer, search_texts, args.layers,
                                    args.transfer_seeds, args.ridge, args.seed)
    seed_bits += pattern_seeds(args.seed_patterns, args.layers, num_layers)
    settings = SearchSettings(
        max_drop=args.max_drop, budget=args.budget, methods=(GA,),
        ga=GAConfig(population=args.population, generations=10_000, seed=args.seed,
                    layers=args.layers, seeds=tuple(seed_bits)),
    )
    ga = summary(run_search(lambda g: search.get(g), num_layers, settings, run))[GA]
    # 1b. Proposals of an additive model fitted on every score so far, each one measured.
    proposals = refine(search, [from_bits(t["pattern"]) for t in ga["trials"]], args)
    search_seconds = time.perf_counter() - began
    tried = [(t["drop"], t["order"], t["pattern"], "ga") for t in ga["trials"]]
    tried += [(p["drop"], len(tried) + i, p["pattern"], "surrogate")
              for i, p in enumerate(proposals)]
    drop, _, pattern, source = min(tried)
    best = {"pattern": pattern, "drop": drop, "from": source}
    ga_genome = from_bits(best["pattern"])

    # 2. Everything the report compares, on the search texts, unseen texts and held-out halves.
    candidates: dict[str, Genome] = {"ga": ga_genome}
    for k in (int(k) for k in args.first_k.split(",") if k):
        candidates[f"first-{k}"] = first_k(k, num_layers)
    if args.previous is not None:
        layers = json.loads(args.previous.read_text())["compressed_layers"]
        candidates["previous"] = from_layers(layers, num_layers)
    report: dict[str, dict[str, Any]] = {"search": {}, "unseen": {}, "heldout": {}}
    for label, genome in tqdm(candidates.items(), desc="unseen texts", unit="pattern"):
        report["search"][label] = search.get(genome)
        report["unseen"][label] = unseen.get(genome)
    for label in tqdm(["ga", f"first-{args.layers}"], desc="held-out halves", unit="pattern"):
        if label in candidates:
            report["heldout"][label] = heldout.get(candidates[label])

    # 3. Longer contexts: the GA's pattern and first-k of the same size on the unseen texts.
    long: dict[str, dict[str, Any]] = {}
    for spec in (s for s in args.long.split(",") if s):
        context, count = (int(x) for x in spec.split(":"))
        at_context = scores(unseen_texts, "all", context, count)
        long[str(context)] = {label: at_context.get(candidates[label])
                              for label in args.long_patterns.split(",") if label in candidates}

    print_tables(args, candidates, report, long, search_texts, unseen_texts)
    results = {
        "model": args.model.name,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                     if k not in ("out", "write_pattern", "model", "previous")},
        "search_seconds": search_seconds,
        "patterns": {label: [i for i, b in enumerate(g) if b] for label, g in candidates.items()},
        "ga": {"evaluations": ga["evaluations"], "stopped_by": ga["stopped_by"],
               "best": best["pattern"], "best_from": best["from"], "trials": ga["trials"],
               "proposals": proposals},
        **report,
        "long_context": long,
        "command": "python " + " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
    }
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"plot: {plot(args, candidates, report, unseen_texts)}")
    if args.write_pattern:
        write_pattern(args, model, ga_genome, results, unseen_texts)
    return 0


def print_tables(args: argparse.Namespace, candidates: dict[str, Genome], report: dict,
                 long: dict, search_texts: list[str], unseen_texts: list[str]) -> None:
    for title, key, texts in (("search halves (what the search saw)", "search", search_texts),
                              ("unseen texts", "unseen", unseen_texts),
                              ("held-out halves of the search texts", "heldout", search_texts)):
        print(f"\n{title}: relative perplexity increase, % ± standard error")
        print(header(texts))
        for label, record in report[key].items():
            print(row(label, candidates[label], record, texts))
    for context, records in long.items():
        print(f"\nunseen texts at {context} tokens")
        print(header(unseen_texts))
        for label, record in records.items():
            print(row(label, candidates[label], record, unseen_texts))


def plot(args: argparse.Namespace, candidates: dict[str, Genome], report: dict,
         unseen_texts: list[str]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    family = sorted((sum(g), label) for label, g in candidates.items()
                    if label.startswith("first-"))
    for i, name in enumerate(unseen_texts):
        color = f"C{i}"
        xs = [report["unseen"][label]["kv_saved_fraction"] * 100 for _, label in family]
        ys = [report["unseen"][label]["texts"][name]["drop"] * 100 for _, label in family]
        ax.plot(xs, ys, marker="o", ms=3, color=color, label=f"first-k on {name}")
        ga = report["unseen"]["ga"]
        ax.errorbar([ga["kv_saved_fraction"] * 100], [ga["texts"][name]["drop"] * 100],
                    yerr=[ga["texts"][name]["drop_stderr"] * 100], marker="*", ms=14,
                    color=color, mec="black", capsize=3, ls="none",
                    label=f"search ({sum(candidates['ga'])} layers) on {name}")
    ax.axhline(args.max_drop * 100, color="grey", ls="--", lw=1, label="bound")
    ax.set_xlabel(f"KV saved at {args.context} tokens (%)")
    ax.set_ylabel("relative perplexity increase (%)")
    ax.set_title(f"SmolLM2-135M, sink {args.sink} + recent {args.recent}: texts the search "
                 "never saw", fontsize=9)
    ax.legend(fontsize=7)
    path = args.out / "generalise.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def write_pattern(args: argparse.Namespace, model: Any, genome: Genome, results: dict,
                  unseen_texts: list[str]) -> None:
    unseen = results["unseen"]["ga"]
    provenance = {
        "method": "genetic algorithm (omniinfer.attn.ga), fixed size, seeded with first-k"
                  + (f" and {args.transfer_seeds} proposals of an additive model fitted on "
                     f"the scores of {args.transfer.parent.parent.name}" if args.transfer else "")
                  + ", "
                  f"then {args.refine} proposals of an additive model (omniinfer.attn.surrogate)"
                  f"; the best came from the {results['ga']['best_from']}",
        "objective": "smallest worst-text relative perplexity increase at "
                     f"{args.layers} compressed layers",
        "search_data": f"{args.search_texts}: search halves, {args.search_windows} x "
                       f"{args.context} tokens each",
        "search_worst_drop": results["search"]["ga"]["drop"],
        "unseen_data": f"{args.unseen_texts}: {args.unseen_windows} x {args.context} each",
        "unseen_drops": {n: unseen["texts"][n]["drop"] for n in unseen_texts},
        "kv_saved_fraction": kv_saved_fraction(
            sum(genome), len(genome), args.sink, args.recent, args.context),
        "context": args.context,
        "seed": args.seed,
        "budget": args.budget,
        "evaluations": results["ga"]["evaluations"] + len(results["ga"]["proposals"]),
        "population": args.population,
        "benchmark": "benchmark/attn/generalise.py",
    }
    layers = [i for i, b in enumerate(genome) if b]
    found = pattern_from_layers(layers, model.config, args.sink, args.recent, args.model.name,
                                provenance)
    found.save(args.write_pattern)
    print(f"wrote {args.write_pattern}: layers {layers}")


if __name__ == "__main__":
    raise SystemExit(main())
