"""Retrieval beside perplexity: passkey accuracy by needle depth, with and without a pattern.

A sink + recent layer forgets the middle of its context, and perplexity on running text barely
sees that; a passkey hidden at some depth of a long haystack does. For each context
(``--contexts``) and needle depth (``--depths``) the script builds ``--cases-per-depth`` cases
(a fresh five-digit key, different haystack text: the held-out half of a shipped text), and
scores every case on the real model through the masked evaluator under three conditions: no
pattern, each ``--pattern`` (its layers, sink and recent), and the first-k pattern with as
many compressed layers (same sink and recent). A case passes when greedy decoding would
return the key (``omniinfer.attn.passkey``). Then, unless ``--server-context 0``, the cases of
that context go once through a real SGLang CPU server started with the first pattern: the
server's greedy answer is checked against the key and against the masked evaluator's verdict
for the same case.

Prints a table per context and writes ``results/retrieval.json`` and ``retrieval.png``.

    .venv/bin/python benchmark/attn/retrieval.py                       # 2K, 4K, 8K; server at 2K
    .venv/bin/python benchmark/attn/retrieval.py --contexts 2048 --server-context 0
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from pathlib import Path
from typing import Any

from tqdm import tqdm

from omniinfer.attn import baselines, evaluator, masks, passkey, text
from omniinfer.attn.pattern import Pattern, load
from omniinfer.bench.records import write_results

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SHIPPED = ROOT / "python" / "omniinfer" / "attn" / "patterns" / "smollm2-135m.json"
NO_PATTERN = "none"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=evaluator.DEFAULT_MODEL)
    p.add_argument("--pattern", type=Path, action="append", default=None,
                   help=f"pattern file, repeatable (default: {SHIPPED.name})")
    p.add_argument("--contexts", default="2048,4096,8192", help="tokens per case, comma list")
    p.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9",
                   help="needle position as a share of the haystack, comma list")
    p.add_argument("--cases-per-depth", default="2,2,1",
                   help="cases per depth for each context (comma list, one per --contexts, or "
                   "one for all): an 8K forward pass takes about a minute on two cores")
    p.add_argument("--haystack", default="tinyshakespeare",
                   help=f"shipped text (its held-out half), or '{passkey.REPEATED_FILLER}': the "
                   "classic filler of a few sentences repeated")
    p.add_argument("--server-context", type=int, default=2048,
                   help="context whose cases also go through a real patterned server; 0 skips")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=HERE / "results" / "retrieval.json")
    args = p.parse_args(argv)
    args.pattern = args.pattern or [SHIPPED]
    args.contexts = [int(c) for c in args.contexts.split(",")]
    args.depths = [float(d) for d in args.depths.split(",")]
    per = [int(n) for n in args.cases_per_depth.split(",")]
    if len(per) == 1:
        per = per * len(args.contexts)
    if len(per) != len(args.contexts) or min(per) < 1:
        p.error("--cases-per-depth: one positive count, or one per --contexts")
    args.cases_per_depth = dict(zip(args.contexts, per, strict=True))
    if args.server_context and args.server_context not in args.contexts:
        p.error("--server-context must be one of --contexts (or 0)")
    return args


def conditions(patterns: list[Pattern], names: list[str]) -> dict[str, masks.Windows | None]:
    """Condition name -> per-layer windows: no pattern, each pattern, its first-k twin."""
    out: dict[str, masks.Windows | None] = {NO_PATTERN: None}
    for found, name in zip(patterns, names, strict=True):
        out[name] = masks.windows_for(found.mask, found.sink, found.recent)
        k = len(found.compressed_layers)
        out[f"first-{k} ({found.sink}+{found.recent})"] = masks.windows_for(
            baselines.first_k(k, found.num_layers), found.sink, found.recent)
    return out


def summarise(cases: list[passkey.PasskeyCase], passed: list[bool]) -> dict[str, Any]:
    by_depth: dict[str, list[bool]] = {}
    for case, ok in zip(cases, passed, strict=True):
        by_depth.setdefault(f"{case.depth:g}", []).append(ok)
    return {"accuracy": sum(passed) / len(passed), "cases": len(passed),
            "by_depth": {d: sum(v) / len(v) for d, v in by_depth.items()},
            "passed": passed}


def through_server(args: argparse.Namespace, cases: list[passkey.PasskeyCase],
                   masked: list[bool]) -> dict[str, Any]:
    """The cases' prompts (without the key) through a real server with the first pattern."""
    from omniinfer.child_process import free_port
    from omniinfer.cpu.server_env import cpu_env
    from omniinfer.testbed.servers import SGLangServer, cpu_server_command

    port = free_port()
    context = max(len(c.ids) for c in cases)
    command = cpu_server_command(args.model, port, 4 * context + 512, extra_args=[
        "--omni-attn-pattern", str(args.pattern[0]), "--chunked-prefill-size", "512"])
    log = args.out.parent / "logs" / "retrieval_server.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    answers: list[bool] = []
    began = time.perf_counter()
    with SGLangServer(command, cpu_env(), log, port, ready_timeout_s=900) as server:
        for case in tqdm(cases, desc="server", unit="case"):
            key_ids = list(case.ids[case.answer_start:])
            body = {"input_ids": list(case.ids[:case.answer_start]),
                    "sampling_params": {"max_new_tokens": len(key_ids), "temperature": 0.0}}
            request = urllib.request.Request(
                f"{server.base_url}/generate", data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=900) as reply:
                out = json.loads(reply.read())
            ids = out.get("output_ids")
            answers.append(list(ids) == key_ids if ids is not None
                           else out["text"].strip().startswith(case.key))
    agree = sum(a == m for a, m in zip(answers, masked, strict=True))
    return {"context": context, "pattern": args.pattern[0].name,
            **summarise(cases, answers), "agrees_with_masked": agree,
            "seconds": time.perf_counter() - began}


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = list(results)
    fig, axes = plt.subplots(1, len(contexts), figsize=(4.5 * len(contexts), 3.6), sharey=True,
                             squeeze=False)
    for ax, context in zip(axes[0], contexts, strict=True):
        for name, row in results[context].items():
            depths = [float(d) for d in row["by_depth"]]
            ax.plot(depths, [100 * a for a in row["by_depth"].values()], marker="o", label=name)
        ax.set_title(f"{context} tokens")
        ax.set_xlabel("needle depth")
        ax.set_ylim(-5, 105)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("passkey accuracy (%)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(args.model)
    patterns = [load(p, config=config, model_id=str(args.model)) for p in args.pattern]
    names = [p.stem for p in args.pattern]
    model, tokenizer = evaluator.load_model(args.model)
    if args.haystack == passkey.REPEATED_FILLER:
        # each context's cases read the haystack from its start: the largest of them bounds it
        needed = max(len(args.depths) * args.cases_per_depth[c] * c for c in args.contexts)
        haystack, described = passkey.repeated_filler(needed), "a few sentences repeated"
    else:
        haystack = text.part(text.read(args.haystack), "heldout")
        described = f"{args.haystack} (held-out half)"
    windows = conditions(patterns, names)
    results: dict[str, dict[str, Any]] = {}
    all_cases: dict[int, list[passkey.PasskeyCase]] = {}
    total = sum(len(args.depths) * args.cases_per_depth[c] for c in args.contexts) * len(windows)
    bar = tqdm(total=total, unit="case")
    for context in args.contexts:
        depths = [d for d in args.depths for _ in range(args.cases_per_depth[context])]
        cases = passkey.build_cases(tokenizer, haystack, context, depths, seed=args.seed)
        all_cases[context] = cases
        results[str(context)] = {}
        for name, window in windows.items():
            bar.set_description(f"{context} {name}")
            passed = []
            for case in cases:
                passed.extend(passkey.retrieved(model, [case], window))
                bar.update(1)
            results[str(context)][name] = summarise(cases, passed)
    bar.close()
    report: dict[str, Any] = {
        "model": args.model.name, "haystack": described,
        "patterns": {n: {"layers": list(p.compressed_layers), "sink": p.sink,
                         "recent": p.recent,
                         "kv_saved": {str(c): p.kv_saved_fraction(c) for c in args.contexts}}
                     for n, p in zip(names, patterns, strict=True)},
        "depths": args.depths, "results": results}
    if args.server_context:
        cases = all_cases[args.server_context]
        masked = results[str(args.server_context)][names[0]]["passed"]
        report["server"] = through_server(args, cases, masked)
    for context, rows in results.items():
        base = rows[NO_PATTERN]["accuracy"]
        print(f"\n{context} tokens, {rows[NO_PATTERN]['cases']} cases "
              f"(depths {', '.join(f'{d:g}' for d in args.depths)})")
        print("| condition | accuracy | vs none (points) | by depth |\n|---|---|---|---|")
        for name, row in rows.items():
            depth = " ".join(f"{100 * a:.0f}" for a in row["by_depth"].values())
            print(f"| {name} | {100 * row['accuracy']:.0f} % | "
                  f"{100 * (row['accuracy'] - base):+.0f} | {depth} |")
    if "server" in report:
        s = report["server"]
        print(f"\nreal server ({s['pattern']}, {s['context']} tokens): "
              f"{100 * s['accuracy']:.0f} %, agrees with the masked evaluator on "
              f"{s['agrees_with_masked']} of {s['cases']} cases")
    write_results(args.out, report)
    plot(results, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png').name}")
    return report


if __name__ == "__main__":
    main()
