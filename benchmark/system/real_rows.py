"""Each sparse technique's effect on the real SGLang engine, on the whole system's model.

SmolLM2-MoE (``.cache/models/SmolLM2-135M-MoE``: 4 experts, top 2, a skewed router, outputs
equal to the dense SmolLM2's), real CPU servers started one after another so they never share
the cores, every pair in one invocation:

- pattern: one server plain and one with ``--omni-attn-pattern smollm2-135m-moe.json`` at the
  same ``--max-total-tokens``; the same burst of long requests on each; the peak of running
  requests (``/v1/loads``) is how many were admitted at once
  (``benchmark/attn_runtime/burst.py``);
- placement: a 2-rank expert-parallel server (``--tp 2 --ep 2 --ep-num-redundant-experts 2``)
  without and with ``--enable-omni-placement``; concurrent streams of one skewed workload
  (real text), a warm-up long enough for the controller to migrate, then the decode step time
  (inter-token latency of streams decoding in one batch) measured; ``--rounds`` alternates
  the two servers.

    python benchmark/system/real_rows.py                 # both, about 15 minutes
    python benchmark/system/real_rows.py --only placement --rounds 3

Prints the figures with their spreads and writes ``results/system/real_rows.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE.parent / "attn_runtime"))
sys.path.insert(0, str(HERE.parent / "placement"))

from burst import serve_burst  # noqa: E402
from migration_stall import stream  # noqa: E402  (one stream's token arrival times)

from omniinfer.launch import SGLangServer, cpu_env, cpu_server_command, free_port  # noqa: E402

MOE = ROOT / ".cache" / "models" / "SmolLM2-135M-MoE"
PATTERN = ROOT / "python" / "omniinfer" / "attn" / "patterns" / "smollm2-135m-moe.json"
EP = ["--tp", "2", "--ep", "2", "--ep-num-redundant-experts", "2"]


def _prompts(tokenizer: Any, count: int, length: int, offset: int = 0) -> list[list[int]]:
    import omniinfer.data

    text = (Path(omniinfer.data.__file__).parent / "text" / "paradise_lost.txt").read_text()
    ids = tokenizer.encode(text, add_special_tokens=False)
    return [ids[offset + i * 97: offset + i * 97 + length] for i in range(count)]


def pattern_row(args: argparse.Namespace, tokenizer: Any, logs: Path) -> dict[str, Any]:
    prompts = _prompts(tokenizer, args.burst, args.context - args.new_tokens)
    out: dict[str, Any] = {}
    for name, extra in (("plain", []), ("pattern", ["--omni-attn-pattern", str(PATTERN)])):
        result, _status = serve_burst(MOE, args.max_total_tokens, 512, extra,
                                      logs / f"attn-{name}.log", prompts, args.new_tokens)
        out[name] = result
        print(f"  pattern row, {name:<8} peak running {result['peak_running']}, "
              f"{result['seconds']:.1f} s", flush=True)
    out["ratio_peak_running"] = out["pattern"]["peak_running"] / max(
        1, out["plain"]["peak_running"])
    return out


async def _streams(url: str, prompts: list[list[int]], tokens: int) -> list[list[float]]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        return list(await asyncio.gather(*(stream(session, url, p, tokens) for p in prompts)))


def _decode_step_s(streams: list[list[float]]) -> float:
    """Median inter-token gap over the steps every stream decodes together (past the first
    token of the last to start, before the first to end)."""
    start = max(s[1] for s in streams)
    end = min(s[-1] for s in streams)
    gaps = [b - a for s in streams for a, b in zip(s, s[1:], strict=False) if start <= a and b <= end]
    return float(np.median(gaps)) if gaps else float("nan")


def placement_server(name: str, args: argparse.Namespace, prompts: list[list[int]],
                     logs: Path) -> dict[str, Any]:
    extra = [*EP, *(["--enable-omni-placement", "--omni-placement-interval",
                     str(args.interval)] if name == "omni" else [])]
    port = free_port()
    command = cpu_server_command(MOE, port, 8192, extra)
    log = logs / f"placement-{name}-{port}.log"
    with SGLangServer(command, cpu_env(threads_bind="0|1"), log, port,
                      ready_timeout_s=900) as server:
        asyncio.run(_streams(server.base_url, prompts, args.warmup_tokens))  # migrations here
        streams = asyncio.run(_streams(server.base_url, prompts, args.tokens))
        status = None
        if name == "omni":
            with urllib.request.urlopen(server.base_url + "/omni/placement", timeout=30) as r:
                status = json.loads(r.read())
    step = _decode_step_s(streams)
    adopted = [m for m in (status or {}).get("migrations", []) if m.get("state") == "adopted"]
    last = next((d for d in (status or {}).get("decisions", [])
                 if d.get("adopted_layers")), None)  # the first adopted: B before any move
    return {"decode_step_ms": step * 1000, "migrations_adopted": len(adopted),
            "b_before": last and float(np.mean(last["b_before"])),
            "b_after_planned": last and float(np.mean(last["b_after_planned"]))}


def placement_row(args: argparse.Namespace, tokenizer: Any, logs: Path) -> dict[str, Any]:
    prompts = _prompts(tokenizer, args.streams, args.prompt_len, offset=5000)
    runs: dict[str, list[dict[str, Any]]] = {"none": [], "omni": []}
    for round_ in range(args.rounds):
        for name in (("none", "omni") if round_ % 2 == 0 else ("omni", "none")):
            result = placement_server(name, args, prompts, logs)
            runs[name].append(result)
            print(f"  placement row, round {round_}, {name:<5} decode step "
                  f"{result['decode_step_ms']:.1f} ms, migrations {result['migrations_adopted']}"
                  f", mean B {result['b_before']} -> {result['b_after_planned']}", flush=True)
    steps = {k: [r["decode_step_ms"] for r in v] for k, v in runs.items()}
    paired = [o / n for o, n in zip(steps["omni"], steps["none"], strict=True)]
    return {"runs": runs, "decode_step_ms": {k: {"median": statistics.median(v), "min": min(v),
                                                 "max": max(v)} for k, v in steps.items()},
            "omni_over_none": {"median": statistics.median(paired), "min": min(paired),
                               "max": max(paired)}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=("pattern", "placement"), default=None)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--max-total-tokens", type=int, default=12288)
    p.add_argument("--burst", type=int, default=10)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--warmup-tokens", type=int, default=48)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--interval", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=HERE.parent / "results" / "system" /
                   "real_rows.json")
    args = p.parse_args()
    from transformers import AutoTokenizer

    if not (MOE / "config.json").is_file():
        raise SystemExit(f"{MOE} is missing: scripts/setup.sh builds it")
    tokenizer = AutoTokenizer.from_pretrained(MOE)
    logs = Path(tempfile.mkdtemp(prefix="real-rows-"))
    shown = {k: (str(v.resolve().relative_to(ROOT)) if isinstance(v, Path) and
                 v.resolve().is_relative_to(ROOT) else str(v)) for k, v in vars(args).items()}
    results: dict[str, Any] = {"model": MOE.name, "args": shown}
    if args.only in (None, "pattern"):
        results["pattern"] = pattern_row(args, tokenizer, logs)
    if args.only in (None, "placement"):
        results["placement"] = placement_row(args, tokenizer, logs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    if "pattern" in results:
        r = results["pattern"]
        print(f"pattern: peak running {r['plain']['peak_running']} plain -> "
              f"{r['pattern']['peak_running']} patterned at --max-total-tokens "
              f"{args.max_total_tokens} ({r['ratio_peak_running']:.2f}x)")
    if "placement" in results:
        r = results["placement"]
        s = r["decode_step_ms"]
        print(f"placement: decode step {s['none']['median']:.1f} ms without "
              f"({s['none']['min']:.1f}-{s['none']['max']:.1f}), {s['omni']['median']:.1f} ms "
              f"with ({s['omni']['min']:.1f}-{s['omni']['max']:.1f}); with/without per round "
              f"{r['omni_over_none']['median']:.3f} ({r['omni_over_none']['min']:.3f}-"
              f"{r['omni_over_none']['max']:.3f})")
    print(f"results: {args.out}; logs: {logs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
