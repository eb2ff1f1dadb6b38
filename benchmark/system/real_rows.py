"""Each sparse technique's effect on the real SGLang engine, on the whole system's model.

SmolLM2-MoE (``.cache/models/SmolLM2-135M-MoE``: 4 experts, top 2, a skewed router, outputs
equal to the dense SmolLM2's), real CPU servers started one after another so they never share
the cores, every pair in one invocation:

- pattern: one server plain and one with ``--omni-attn-pattern smollm2-135m-moe.json`` at the
  same ``--max-total-tokens``; the same burst of long requests on each; the peak of running
  requests (``/v1/loads``) is how many were admitted at once
  (``benchmark/attn_runtime/burst.py``);
- placement: a 2-rank expert-parallel server (``--tp 2 --ep 2 --ep-num-redundant-experts 2``)
  without a rebalancer, with SGLang's own ``--enable-eplb`` (the same spare slots, rebalancing
  every ``--interval`` passes) and with ``--enable-omni-placement`` (the same interval);
  concurrent streams of one skewed workload (real text), a warm-up long enough for both
  rebalancers to act, then the decode step time (inter-token latency of streams decoding in
  one batch) measured; ``--rounds`` rotates the order of the three servers.

    python benchmark/system/real_rows.py                 # both, about 20 minutes
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

from omniinfer.child_process import free_port  # noqa: E402
from omniinfer.cpu.server_env import cpu_env  # noqa: E402
from omniinfer.testbed.servers import SGLangServer, cpu_server_command  # noqa: E402

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
    rebalancer = {"none": [], "eplb": ["--enable-eplb", "--eplb-rebalance-num-iterations",
                                       str(args.interval)],
                  "omni": ["--enable-omni-placement", "--omni-placement-interval",
                           str(args.interval)]}[name]
    extra = [*EP, *rebalancer]
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
    rebalances = log.read_text(errors="replace").count("[EPLBManager] rebalance end")
    adopted = [m for m in (status or {}).get("migrations", []) if m.get("state") == "adopted"]
    last = next((d for d in (status or {}).get("decisions", [])
                 if d.get("adopted_layers")), None)  # the first adopted: B before any move
    return {"decode_step_ms": step * 1000, "migrations_adopted": len(adopted),
            "eplb_rebalances": rebalances,
            "b_before": last and float(np.mean(last["b_before"])),
            "b_after_planned": last and float(np.mean(last["b_after_planned"]))}


def placement_row(args: argparse.Namespace, tokenizer: Any, logs: Path) -> dict[str, Any]:
    prompts = _prompts(tokenizer, args.streams, args.prompt_len, offset=5000)
    names = ("none", "eplb", "omni")
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for round_ in range(args.rounds):
        for name in names[round_ % 3:] + names[:round_ % 3]:
            try:
                result = placement_server(name, args, prompts, logs)
            except (aiohttp.ClientError, RuntimeError, OSError) as exc:
                failure = _server_failure(logs, name) or f"{type(exc).__name__}: {exc}"
                runs.setdefault(f"{name}_failed", []).append({"error": failure})
                print(f"  placement row, round {round_}, {name:<5} FAILED: {failure}", flush=True)
                continue
            runs[name].append(result)
            print(f"  placement row, round {round_}, {name:<5} decode step "
                  f"{result['decode_step_ms']:.1f} ms, omni migrations "
                  f"{result['migrations_adopted']}, EPLB rebalances {result['eplb_rebalances']}, "
                  f"mean B {result['b_before']} -> {result['b_after_planned']}", flush=True)
    steps = {k: [r["decode_step_ms"] for r in v] for k, v in runs.items()
             if v and not k.endswith("_failed")}

    def paired(a: str, b: str) -> dict[str, float] | None:
        if len(steps.get(a, ())) != args.rounds or len(steps.get(b, ())) != args.rounds:
            return None  # a server failed in some round: no paired figure
        ratios = [x / y for x, y in zip(steps[a], steps[b], strict=True)]
        return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}

    return {"runs": runs, "decode_step_ms": {k: {"median": statistics.median(v), "min": min(v),
                                                 "max": max(v)} for k, v in steps.items()},
            "omni_over_none": paired("omni", "none"), "eplb_over_none": paired("eplb", "none"),
            "omni_over_eplb": paired("omni", "eplb")}


def _server_failure(logs: Path, name: str) -> str | None:
    """The exception line a server of ``name`` logged last, if any."""
    for log in sorted(logs.glob(f"placement-{name}-*.log"), key=lambda p: p.stat().st_mtime,
                      reverse=True):
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines()
                 if "Error:" in line and "Ignore import error" not in line]
        if lines:
            return lines[-1][:300]
    return None


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
        for name in ("none", "eplb", "omni"):
            if name in s:
                print(f"placement: decode step {name:<5} {s[name]['median']:.1f} ms "
                      f"({s[name]['min']:.1f}-{s[name]['max']:.1f})")
            for failed in r["runs"].get(f"{name}_failed", []):
                print(f"placement: {name} server failed: {failed['error']}")
        for key in ("omni_over_none", "eplb_over_none", "omni_over_eplb"):
            if r[key] is not None:
                print(f"placement: {key} per round {r[key]['median']:.3f} "
                      f"({r[key]['min']:.3f}-{r[key]['max']:.3f})")
    print(f"results: {args.out}; logs: {logs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
