"""``omniinfer attn search|eval``: find a layer pattern, or score one on held-out text."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from omniinfer.attn import cost, evaluator, masks, passkey, pattern, retrieval, text
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
        q.add_argument("--device", choices=evaluator.DEVICES, default="cpu",
                       help="where the model runs (npu needs torch_npu)")

    s = sub.add_parser("search", help="genetic-algorithm search for compressed layers")
    common(s, "search", 1)
    s.add_argument("--sink", type=int, default=128)
    s.add_argument("--recent", type=int, default=384)
    s.add_argument("--max-drop", type=float, default=0.01,
                   help="bound on the relative perplexity increase")
    s.add_argument("--retrieval-cases", type=int, default=5,
                   help="passkey cases per kind (one key; three look-alike keys) and haystack, "
                   "depths spread evenly; a pattern must also hold retrieval (0: perplexity only)")
    s.add_argument("--max-retrieval-drop", type=float, default=5.0,
                   help="bound, in points, on the retrieval accuracy lost in any depth band")
    s.add_argument("--retrieval-haystacks", default=f"{passkey.REPEATED_FILLER},tinyshakespeare",
                   help="haystacks of the retrieval cases: the repeated filler and/or shipped "
                   "texts (their search half; judging uses the held-out half)")
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
          recent: int) -> tuple[Any, Any, evaluator.Evaluator, float]:
    """``--model`` (model, tokenizer) on ``--device``, an evaluator on the windows ``--text/
    --part/--context/--windows`` choose, and the seconds per window of its reference pass;
    OSError or ValueError when the model, the device or the text cannot serve."""
    model, tokenizer = evaluator.load_model(args.model, args.device)
    body = text.part(text.read(args.text), args.part)
    windows = text.windows(tokenizer, body, args.context, args.windows)
    began = time.perf_counter()
    ev = evaluator.Evaluator(model, windows, sink, recent)
    return model, tokenizer, ev, (time.perf_counter() - began) / len(windows)


def _objective_settings(args: argparse.Namespace) -> dict[str, Any]:
    """What a run folder's evaluations depend on; a resumed run must ask for the same."""
    keys = ("text", "part", "context", "windows", "sink", "recent", "max_drop",
            "retrieval_cases", "max_retrieval_drop", "retrieval_haystacks", "seed")
    return {"model": args.model.name, **{k: str(getattr(args, k)) for k in keys}}


def _check_run_dir(run_dir: Path, settings: dict[str, Any]) -> None:
    """Record the objective in ``run_dir``, or ValueError if it holds another one's evaluations."""
    path = run_dir / "objective.json"
    earlier = [n for n in ("evaluations.json", "ga-checkpoint.json") if (run_dir / n).exists()]
    if earlier and not path.exists():
        raise ValueError(f"--run-dir {run_dir} holds evaluations of a search that recorded no "
                         "objective; give another --run-dir")
    if path.exists():
        try:
            before = json.loads(path.read_text(encoding="utf-8"))
        except ValueError:
            before = None
        if before != settings:
            raise ValueError(f"--run-dir {run_dir} holds a search with other settings; "
                             "give another --run-dir")
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings, indent=1) + "\n", encoding="utf-8")


def run_search_command(args: argparse.Namespace) -> int:
    methods = (GA, *[m for m in args.baselines.split(",") if m])
    checked = args.retrieval_cases > 0
    try:
        if args.retrieval_cases < 0 or args.max_retrieval_drop <= 0 or args.max_drop <= 0:
            raise ValueError("--retrieval-cases must be >= 0, --max-drop and "
                             "--max-retrieval-drop > 0")
        if checked and not [h for h in args.retrieval_haystacks.split(",") if h]:
            raise ValueError("--retrieval-haystacks names no haystack")
        settings = SearchSettings(
            max_drop=args.max_drop,
            budget=args.budget,
            methods=methods,
            ga=GAConfig(population=args.population, generations=args.generations, seed=args.seed),
            time_limit_s=args.time_limit * 60 if args.time_limit > 0 else None,
            key="constraint",
        )
    except ValueError as exc:
        return _fail(str(exc))
    if not args.model.is_dir():
        return _fail(f"--model: no model folder at {args.model}")
    run_dir = args.run_dir or args.output.with_suffix(".run")
    try:
        _check_run_dir(run_dir, _objective_settings(args))
        model, tokenizer, ev, per_window = _load(args, args.sink, args.recent)
        check, per_case = None, 0.0
        if checked:
            check = retrieval.RetrievalCheck(
                model, tokenizer, args.context, args.retrieval_cases,
                haystacks=[h for h in args.retrieval_haystacks.split(",") if h],
                part="search", seed=args.seed, cache_dir=run_dir)
            began = time.perf_counter()  # one case timed (the full answers may be cached)
            passkey.retrieved(model, check.cases[:1], None)
            per_case = time.perf_counter() - began
    except (OSError, ValueError) as exc:
        return _fail(str(exc))
    for line in cost.describe(args.model, model.config, args.context, args.windows,
                              len(check.cases) if check else 0, args.budget, len(methods),
                              per_window, per_case):
        print(line, flush=True)
    if check is not None:
        print(f"retrieval: the full model answers {sum(check.full_passed)} of {len(check.cases)} "
              "cases; a pattern may lose at most "
              f"{args.max_retrieval_drop:g} points in any band", flush=True)
    records: dict[str, dict[str, Any]] = {}

    def evaluate(genome: tuple[bool, ...]) -> dict[str, Any]:
        figures = ev.evaluate(genome).to_json()
        figures["kv_saved_fraction"] = ev.kv_saved_fraction(genome, args.context)
        figures["constraint"] = figures["drop"]
        if check is not None:
            figures.update(check.score(genome, args.sink, args.recent))
            figures["constraint"] = retrieval.constraint(
                figures["drop"], args.max_drop, figures["retrieval_loss_points"],
                args.max_retrieval_drop)
        if all(genome):  # the server keeps at least one full layer: never a candidate
            figures["constraint"] = float("inf")
        records[to_bits(genome)] = figures
        return figures

    results = run_search(evaluate, ev.num_layers, settings, run_dir, not args.no_progress)
    for name, result in results.items():
        best = best_of(result)
        shown = "none within the bounds" if best is None else (
            f"{sum(best)} layers, KV saved {ev.kv_saved_fraction(best) * 100:.1f}%"
        )
        print(f"{name}: {result.evaluations} evaluations ({result.stopped_by}), best: {shown}")
    ga = results[GA]
    best = best_of(ga)
    if best is None:
        bound = f"--max-drop {args.max_drop}" + (
            f" and --max-retrieval-drop {args.max_retrieval_drop:g}" if checked else "")
        return _fail(f"no pattern within {bound} found; nothing written")
    trial = next(t for t in ga.trials if t["pattern"] == ga.best)
    fitness = {"drop": trial["drop"], "drop_stderr": trial["drop_stderr"],
               "agreement": trial["agreement"], "max_drop": args.max_drop}
    if checked:
        fitness.update({k: trial[k] for k in ("retrieval_loss_points", "retrieval_worst_band",
                                              "retrieval_full", "retrieval_pattern",
                                              "retrieval_cases")},
                       max_retrieval_drop=args.max_retrieval_drop,
                       retrieval_haystacks=args.retrieval_haystacks)
    provenance = {
        "method": "genetic algorithm (omniinfer.attn.ga)",
        "objective": "perplexity and retrieval" if checked else "perplexity",
        "fitness": fitness,
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
    except (pattern.PatternError, OSError, ValueError) as exc:
        return _fail(str(exc))
    try:
        model, tokenizer, ev, _ = _load(args, found.sink, found.recent)
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
        try:
            cases = passkey.build_cases(tokenizer, haystack, args.context, depths)
        except ValueError as exc:
            return _fail(f"--passkey {args.passkey}: {exc}")
        windows_of = masks.windows_for(found.mask, found.sink, found.recent)
        report["passkey_full"] = sum(passkey.retrieved(model, cases, None)) / len(cases)
        report["passkey_pattern"] = sum(passkey.retrieved(model, cases, windows_of)) / len(cases)
    output = args.output or args.pattern.with_suffix(".eval.json")
    output.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    for key, value in report.items():
        print(f"{key}: {value:.4f}" if isinstance(value, float) else f"{key}: {value}")
    print(f"wrote {output}")
    return 0
