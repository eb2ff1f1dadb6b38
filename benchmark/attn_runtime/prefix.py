"""OmniAttn with the radix cache on shared-prefix traffic: three servers, one after another.

A few long system prompts (``--prefixes`` of ``--prefix-len`` tokens), many short questions
after them (``--requests``, ``--question-len`` tokens each), ``--new-tokens`` greedy outputs,
all sent at once to a real SGLang CPU server at one ``--max-total-tokens``. Three servers:

1. ``plain-radix``: no pattern, radix cache (SGLang's default);
2. ``pattern-no-radix``: ``--omni-attn-pattern`` with ``--disable-radix-cache`` (before it);
3. ``pattern-radix``: ``--omni-attn-pattern`` with the sink-aware radix cache (the default).

Both patterned servers get the compressed/full ratio for this traffic
(``runtime_window.shared_prefix_swa_ratio``). Reports output tokens/s, cache hit rate
(reported ``cached_tokens`` over prompt tokens) and peak running requests (``/v1/loads``),
with the load average before and after each run. Writes JSON and a PNG under results/.

Run: .venv/bin/python benchmark/attn_runtime/prefix.py
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from burst import serve_burst

from omniinfer.attn import evaluator, runtime_window, text
from omniinfer.attn.pattern import load
from omniinfer.bench.records import write_results

HERE = Path(__file__).resolve().parent
SEARCHED = HERE.parents[1] / "python" / "omniinfer" / "attn" / "patterns" / "smollm2-135m.json"
QUIET_FLAG = Path("/tmp/omni-quiet-attn")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", type=Path, default=evaluator.DEFAULT_MODEL)
    p.add_argument("--pattern", type=Path, default=SEARCHED)
    p.add_argument("--prefixes", type=int, default=4)
    p.add_argument("--prefix-len", type=int, default=1500)
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--max-total-tokens", type=int, default=8192)
    p.add_argument("--chunked-prefill-size", type=int, default=512)
    p.add_argument("--servers", default="plain-radix,pattern-no-radix,pattern-radix")
    p.add_argument("--out", type=Path, default=HERE / "results" / "prefix.json")
    return p.parse_args(argv)


def workload(args: argparse.Namespace) -> list[list[int]]:
    """Request i: system prompt i % prefixes, then its own question (distinct text)."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(args.model).encode(text.read("paradise_lost"))
    prompts = [ids[k * args.prefix_len : (k + 1) * args.prefix_len] for k in range(args.prefixes)]
    base = args.prefixes * args.prefix_len
    questions = [ids[base + q * args.question_len : base + (q + 1) * args.question_len]
                 for q in range(args.requests)]
    assert all(len(q) == args.question_len for q in questions), "text too short"
    return [prompts[i % args.prefixes] + questions[i] for i in range(args.requests)]


def _relative(arg: str) -> str:
    root = Path(__file__).resolve().parents[2]
    path = Path(arg)
    return str(path.relative_to(root)) if path.is_absolute() and path.is_relative_to(root) else arg


def _loadavg() -> float:
    return os.getloadavg()[0]


def run_server(args: argparse.Namespace, name: str, prompts: list[list[int]],
               extra: list[str], work: Path) -> dict[str, Any]:
    # Paths in the record are relative to the repository, so results carry no machine paths.
    shown = ["--chunked-prefill-size", str(args.chunked_prefill_size), *extra]
    record: dict[str, Any] = {"args": [_relative(a) for a in shown], "load_before": _loadavg()}
    result, status = serve_burst(args.model, args.max_total_tokens, args.chunked_prefill_size,
                                 extra, work / f"{name}.log", prompts, args.new_tokens)
    record.update(result)
    if status is not None:
        record["pools"] = status["pools"]
        record["radix"] = status.get("radix")
    record["load_after"] = _loadavg()
    print(f"{name}: {record['output_tokens_per_s']:.2f} output tok/s, hit rate "
          f"{record['cache_hit_rate']:.2%}, peak running {record['peak_running']}, "
          f"{record['seconds']:.0f} s", flush=True)
    return record


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary["servers"])
    metrics = [("output_tokens_per_s", "output tokens/s"), ("cache_hit_rate", "cache hit rate"),
               ("peak_running", "peak running requests")]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, (key, label) in zip(axes, metrics, strict=True):
        values = [summary["servers"][n][key] for n in names]
        ax.bar(names, values, color=["#888888", "#d08030", "#3070c0"][: len(names)])
        ax.set_title(label)
        ax.tick_params(axis="x", labelrotation=15, labelsize=8)
    fig.suptitle(f"{summary['prefixes']} shared prefixes x {summary['prefix_len']} tokens, "
                 f"{summary['requests']} requests, --max-total-tokens {summary['max_total_tokens']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    pattern = load(args.pattern)
    prompts = workload(args)
    ratio = runtime_window.shared_prefix_swa_ratio(
        args.prefixes, args.prefix_len, args.requests, args.question_len + args.new_tokens,
        pattern.sink, pattern.recent)
    patterned = ["--omni-attn-pattern", str(args.pattern), "--swa-full-tokens-ratio", str(ratio)]
    configs = {
        "plain-radix": [],
        "pattern-no-radix": [*patterned, "--disable-radix-cache"],
        "pattern-radix": patterned,
    }
    work = Path(tempfile.mkdtemp(prefix="attn-prefix-"))
    QUIET_FLAG.touch()
    try:
        servers = {name: run_server(args, name, prompts, configs[name], work)
                   for name in args.servers.split(",")}
    finally:
        QUIET_FLAG.unlink(missing_ok=True)
    summary: dict[str, Any] = {
        "model": args.model.name, "pattern": args.pattern.name,
        "sink": pattern.sink, "recent": pattern.recent,
        "compressed_layers": len(pattern.compressed_layers),
        "prefixes": args.prefixes, "prefix_len": args.prefix_len, "requests": args.requests,
        "question_len": args.question_len, "new_tokens": args.new_tokens,
        "max_total_tokens": args.max_total_tokens, "swa_full_tokens_ratio": ratio,
        "chunked_prefill_size": args.chunked_prefill_size, "cpu_count": os.cpu_count(),
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"), "servers": servers,
    }
    if {"pattern-radix", "pattern-no-radix", "plain-radix"} <= servers.keys():
        rate = {n: s["output_tokens_per_s"] for n, s in servers.items()}
        summary["pattern_radix_over_pattern_no_radix"] = rate["pattern-radix"] / rate[
            "pattern-no-radix"]
        summary["pattern_radix_over_plain_radix"] = rate["pattern-radix"] / rate["plain-radix"]
        print(f"pattern+radix / pattern without radix: "
              f"{summary['pattern_radix_over_pattern_no_radix']:.2f}x; "
              f"/ plain radix: {summary['pattern_radix_over_plain_radix']:.2f}x")
    write_results(args.out, summary, indent=2)
    plot(summary, args.out.with_suffix(".png"))
    return summary


if __name__ == "__main__":
    main()
