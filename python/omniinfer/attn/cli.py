"""``omniinfer attn search|eval``: find a layer pattern, or score one on held-out text."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from omniinfer.attn import evaluator, masks, passkey, pattern, text
from omniinfer.attn.baselines import BASELINES
from omniinfer.attn.ga import GAConfig
from omniinfer.attn.objective import to_bits
from omniinfer.attn.search import GA, SearchSettings, best_of, run_search


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("attn", help="OmniAttn: layer pattern search and evaluation")
    sub = p.add_subparsers(dest="attn_command", required=True)

    def common(q: argparse.ArgumentParser, part: str, windows: int) -> None:
        q.add_argument("--model", type=Path, default=evaluator.DEFAULT_MODEL,
                       help="Hugging Face model folder (Llama/Qwen style)")
        q.add_argument("--text", default="paradise_lost",
                       help=f"shipped text {sorted(text.SHIPPED)} or a UTF-8 file")
        q.add_argument("--part", choices=text.PARTS, default=part,
                       help="which half of the text to use (search and eval never overlap)")
        q.add_argument("--context", type=int, default=2048, help="tokens per window")
        q.add_argument("--windows", type=int, default=windows, help="windows scored")

    s = sub.add_parser("search", help="genetic-algorithm search for compressed layers")
    common(s, "search", 1)
    s.add_argument("--sink", type=int, default=128)
    s.add_argument("--recent", type=int, default=384)
    s.add_argument("--max-drop", type=float, default=0.01,
                   help="bound on the relative perplexity increase")
    s.add_argument("--budget", type=int, default=60, help="distinct patterns evaluated")
    s.add_argument("--population", type=int, default=GAConfig.population)
    s.add_argument("--generations", type=int, default=GAConfig.generations)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--time-limit", type=float, default=25.0,
                   help="minutes per method; the best pattern so far is kept (0: none)")
    s.add_argument("--baselines", default="",
                   help=f"also run these under the same budget: {','.join(BASELINES)}")
    s.add_argument("--run-dir", type=Path, default=None,
                   help="evaluation cache + GA checkpoint (default: OUTPUT.run/); resumes")
    s.add_argument("--output", type=Path, required=True, help="pattern file to write")
    s.add_argument("--no-progress", action="store_true")
    s.set_defaults(func=run_search_command)

    e = sub.add_parser("eval", help="score a pattern against the full model")
    common(e, "heldout", 2)
    e.add_argument("--pattern", type=Path, required=True)
    e.add_argument("--passkey", type=int, default=0,
                   help="passkey cases (depths spread evenly) to also check; 0 skips")
    e.add_argument("--output", type=Path, default=None,
                   help="JSON results (default: PATTERN with suffix .eval.json)")
    e.set_defaults(func=run_eval_command)


def _fail(message: str) -> int:
    print(f"omniinfer: error: {message}", file=sys.stderr)
    return 2


def _load(args: argparse.Namespace, sink: int,
          recent: int) -> tuple[Any, Any, evaluator.Evaluator]:
    """``--model`` (model, tokenizer) and an evaluator on the windows ``--text/--part/--context/
    --windows`` choose; OSError or ValueError when the model or the text cannot serve."""
    model, tokenizer = evaluator.load_model(args.model)
    body = text.part(text.read(args.text), args.part)
    windows = text.windows(tokenizer, body, args.context, args.windows)
    return model, tokenizer, evaluator.Evaluator(model, windows, sink, recent)


def run_search_command(args: argparse.Namespace) -> int:
    methods = (GA, *[m for m in args.baselines.split(",") if m])
    try:
        settings = SearchSettings(
            max_drop=args.max_drop,
            budget=args.budget,
            methods=methods,
            ga=GAConfig(population=args.population, generations=args.generations, seed=args.seed),
            time_limit_s=args.time_limit * 60 if args.time_limit > 0 else None,
        )
    except ValueError as exc:
        return _fail(str(exc))
    if not args.model.is_dir():
        return _fail(f"--model: no model folder at {args.model}")
    try:
        model, _, ev = _load(args, args.sink, args.recent)
    except (OSError, ValueError) as exc:
        return _fail(str(exc))
    records: dict[str, dict[str, Any]] = {}

    def evaluate(genome: tuple[bool, ...]) -> dict[str, Any]:
        figures = ev.evaluate(genome).to_json()
        figures["kv_saved_fraction"] = ev.kv_saved_fraction(genome, args.context)
        records[to_bits(genome)] = figures
        return figures

    run_dir = args.run_dir or args.output.with_suffix(".run")
    results = run_search(evaluate, ev.num_layers, settings, run_dir, not args.no_progress)
    for name, result in results.items():
        best = best_of(result)
        shown = "none within the bound" if best is None else (
            f"{sum(best)} layers, KV saved {ev.kv_saved_fraction(best) * 100:.1f}%"
        )
        print(f"{name}: {result.evaluations} evaluations ({result.stopped_by}), best: {shown}")
    ga = results[GA]
    best = best_of(ga)
    if best is None:
        return _fail(f"no pattern within --max-drop {args.max_drop} found; nothing written")
    trial = next(t for t in ga.trials if t["pattern"] == ga.best)
    provenance = {
        "method": "genetic algorithm (omniinfer.attn.ga)",
        "fitness": {"drop": trial["drop"], "drop_stderr": trial["drop_stderr"],
                    "agreement": trial["agreement"], "max_drop": args.max_drop},
        "data": {"text": str(args.text), "part": args.part, "windows": args.windows,
                 "context": args.context, "tokens_scored": trial["tokens"]},
        "seed": args.seed,
        "budget": args.budget,
        "evaluations": ga.evaluations,
        "stopped_by": ga.stopped_by,
        "kv_saved_fraction": trial["kv_saved_fraction"],
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    layers = [i for i, b in enumerate(best) if b]
    found = pattern.from_layers(
        layers, model.config, args.sink, args.recent, args.model.name, provenance
    )
    found.save(args.output)
    print(f"wrote {args.output}: layers {layers}")
    return 0


def run_eval_command(args: argparse.Namespace) -> int:
    if not args.model.is_dir():
        return _fail(f"--model: no model folder at {args.model}")
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(args.model)
        found = pattern.load(args.pattern, config=config, model_id=str(args.model))
    except pattern.PatternError as exc:
        return _fail(str(exc))
    try:
        model, tokenizer, ev = _load(args, found.sink, found.recent)
    except (OSError, ValueError) as exc:
        return _fail(str(exc))
    metrics = ev.evaluate(found.mask)
    report: dict[str, Any] = {
        "pattern": str(args.pattern),
        "compressed_layers": list(found.compressed_layers),
        "sink": found.sink,
        "recent": found.recent,
        "text": str(args.text),
        "part": args.part,
        "context": args.context,
        "windows": args.windows,
        "ppl_full": metrics.ppl_full,
        "ppl_pattern": metrics.ppl_pattern,
        "relative_ppl_increase": metrics.drop,
        "relative_ppl_increase_stderr": metrics.drop_stderr,
        "next_token_agreement": metrics.agreement,
        "tokens_scored": metrics.tokens,
        "kv_saved_fraction": found.kv_saved_fraction(args.context),
    }
    if args.passkey > 0:
        depths = [(i + 0.5) / args.passkey for i in range(args.passkey)]
        haystack = text.part(text.read("tinyshakespeare"), "heldout")
        cases = passkey.build_cases(tokenizer, haystack, args.context, depths)
        windows_of = masks.windows_for(found.mask, found.sink, found.recent)
        report["passkey_full"] = sum(passkey.retrieved(model, cases, None)) / len(cases)
        report["passkey_pattern"] = sum(passkey.retrieved(model, cases, windows_of)) / len(cases)
    output = args.output or args.pattern.with_suffix(".eval.json")
    output.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    for key, value in report.items():
        print(f"{key}: {value:.4f}" if isinstance(value, float) else f"{key}: {value}")
    print(f"wrote {output}")
    return 0
