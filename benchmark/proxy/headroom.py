"""How much SLO goodput any prefill order could add on the closed-loop paper mix: the headroom.

Reads one or more ``oas_eval.py`` result folders (``results.json``) and, for the paper workload,
prints per router and policy the whole-run completion rate (QPM), the goodput (completions
within the TTFT/TPOT objective per minute) and the share within the objective; then what a
target of ``--ratio`` × the best peer's median goodput asks for: that share of the highest
completion rate any router reached in the same folder.

It also bounds the misses no order can avoid at the start of a closed-loop run: the first
``concurrency`` requests arrive together, and a request's first token needs its whole prompt
prefilled. At the fastest whole-cluster prefill rate measured in the folder (prompt tokens over
the run's busy prefill time), the cluster prefills at most ``rate × slo`` tokens before the
objective passes, so at least as many requests as it takes of the longest opening prompts to
cover the rest miss it, whatever the order. (KV transfer and the first decode step, which also
count towards a first token, are left out: the bound is optimistic for the router.)

Writes ``headroom.json`` into each folder.

    python benchmark/proxy/headroom.py benchmark/results/proxy/smg_feed benchmark/results/proxy/smg_recheck
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from oas_eval import paper_spec  # same folder: the workload a run drew

from omniinfer.bench.workloads import paper


def opening_prompts(meta: dict[str, Any], concurrency: int) -> list[int]:
    """Prompt lengths of the requests the run's clients start together, as oas_eval builds them."""
    total = meta["num_requests"] + meta["requests_per_client"] * concurrency
    spec = paper_spec(total, meta["seed"], meta["output_scale"])
    return [r.prompt_tokens for r in paper(spec)[:concurrency]]


def forced_misses(prompts: list[int], rate: float, slo_s: float) -> int:
    """Fewest opening requests whose prompts the cluster cannot prefill within ``slo_s``."""
    excess = sum(prompts) - rate * slo_s
    count = 0
    for tokens in sorted(prompts, reverse=True):
        if excess <= 0:
            break
        excess -= tokens
        count += 1
    return count


def analyse(folder: Path, ratio: float) -> dict[str, Any]:
    results = json.loads((folder / "results.json").read_text(encoding="utf-8"))
    meta = results["meta"]
    runs = [r for r in results["runs"] if r["workload"] == "paper"]
    if not runs:
        raise SystemExit(f"{folder}: no paper-workload runs")
    by_target: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        by_target.setdefault(run["target"], []).append(run)
    rows = {}
    for target, mine in by_target.items():
        rows[target] = {
            "qpm": [r["summary"]["requests_per_minute"] for r in mine],
            "goodput_qpm": [r["summary"]["goodput_requests_per_minute"] for r in mine],
            "slo_share": [r["slo_share"] for r in mine],
            "p99_ttft_s": [r["summary"]["p99_ttft_ms"] / 1000 for r in mine],
        }
    peers = {t: statistics.median(v["goodput_qpm"]) for t, v in rows.items()
             if not t.startswith("omni:")}
    best_peer = max(peers, key=peers.__getitem__)
    goal = ratio * peers[best_peer]
    top_qpm = max(q for v in rows.values() for q in v["qpm"])
    rate = max(r["summary"]["total_input_tokens"]
               / (r["summary"]["duration"] * statistics.mean(r["prefill_busy_share"]))
               for r in runs)
    concurrency = runs[0]["concurrency"]
    prompts = opening_prompts(meta, concurrency)
    misses = forced_misses(prompts, rate, float(meta["slo_ttft"]))
    completed = runs[0]["summary"]["completed"]
    return {
        "folder": str(folder), "rows": rows, "best_peer": best_peer,
        "best_peer_goodput_qpm": peers[best_peer], "ratio": ratio, "goal_goodput_qpm": goal,
        "top_completion_qpm": top_qpm, "goal_share_of_top_qpm": goal / top_qpm,
        "prefill_tokens_per_s": rate, "opening_requests": concurrency,
        "opening_prompt_tokens": sum(prompts), "forced_misses": misses,
        "max_share_within_slo": 1.0 - misses / completed,
        "max_goodput_qpm": top_qpm * (1.0 - misses / completed),
    }


def show(report: dict[str, Any]) -> None:
    print(f"\n{report['folder']}: paper mix, closed loop at c = {report['opening_requests']}")
    print(f"{'router:policy':<24} {'QPM':>13} {'goodput QPM':>13} {'within SLO':>12} {'P99 TTFT':>12}")
    for target, row in report["rows"].items():
        def cell(values: list[float], fmt: str) -> str:
            return "/".join(format(v, fmt) for v in values)
        print(f"{target:<24} {cell(row['qpm'], '.0f'):>13} {cell(row['goodput_qpm'], '.0f'):>13} "
              f"{cell([s * 100 for s in row['slo_share']], '.0f'):>12} "
              f"{cell(row['p99_ttft_s'], '.2f'):>12}")
    print(f"best peer {report['best_peer']} (median goodput {report['best_peer_goodput_qpm']:.0f}); "
          f"{report['ratio']}x of it = {report['goal_goodput_qpm']:.0f} goodput QPM = "
          f"{report['goal_share_of_top_qpm'] * 100:.1f} % of the highest completion rate seen "
          f"({report['top_completion_qpm']:.0f} QPM)")
    print(f"opening burst: {report['opening_requests']} requests, "
          f"{report['opening_prompt_tokens']:,} prompt tokens; at the fastest prefill rate seen "
          f"({report['prefill_tokens_per_s']:,.0f} tokens/s) at least {report['forced_misses']} "
          f"miss the objective under any order: at most {report['max_share_within_slo'] * 100:.1f} % "
          f"within it, {report['max_goodput_qpm']:.0f} goodput QPM at the highest completion rate")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folders", nargs="+", type=Path, help="oas_eval.py --output-dir folders")
    p.add_argument("--ratio", type=float, default=1.2, help="the goodput target over the best peer")
    args = p.parse_args(argv)
    for folder in args.folders:
        report = analyse(folder, args.ratio)
        show(report)
        (folder / "headroom.json").write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
