"""omniinfer bench vs SGLang's own `python -m sglang.benchmark.serving`, same server, same run.

Both tools drive the same real SGLang CPU server with the same workload shape (random token ids,
fixed input/output lengths, ignore_eos, closed loop at the same concurrency). The runs alternate
(sglang, ours, sglang, ours, ...) so drift of the shared machine hits both. Each round gives a
paired ratio (ours / sglang, measured back to back); the agreement figure is the median of the
paired ratios over the rounds, which a round disturbed by another job cannot move much (the
median of each tool's own figures is printed too). Writes results/compare_sglang_bench.json;
``--reanalyze FILE`` recomputes the figures from the runs recorded in such a file.

    .venv/bin/python benchmark/bench/compare_sglang_bench.py [--model PATH] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from omniinfer.child_process import free_port
from omniinfer.cpu.server_env import cpu_env
from omniinfer.testbed.servers import SGLangServer, cpu_server_command

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).resolve().parent / "results"


def run_sglang_bench(base_url: str, model: Path, args: argparse.Namespace, out: Path) -> dict:
    cmd = [
        sys.executable, "-m", "sglang.benchmark.serving", "--backend", "sglang",
        "--base-url", base_url, "--tokenizer", str(model), "--model", str(model),
        "--dataset-name", "random-ids", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--random-range-ratio", "1.0",
        "--num-prompts", str(args.num_requests), "--max-concurrency", str(args.concurrency),
        "--request-rate", "inf", "--output-file", str(out), "--disable-tqdm", "--seed", "1",
        "--tokenize-prompt",  # send the token ids: decoded random ids re-tokenize to other lengths
    ]
    subprocess.run(cmd, check=True, capture_output=True, text=True, env=cpu_env())
    row = json.loads(out.read_text().strip().splitlines()[-1])
    return {"output_throughput": row["output_throughput"], "median_ttft_ms": row["median_ttft_ms"],
            "completed": row["completed"], "total_input_tokens": row["total_input_tokens"],
            "total_output_tokens": row["total_output_tokens"]}


def run_ours(base_url: str, model: Path, args: argparse.Namespace, out: Path) -> dict:
    cmd = [
        sys.executable, "-m", "omniinfer", "bench", "--base-url", base_url, "--tokenizer", str(model),
        "--workload", "random", "--input-len", str(args.input_len),
        "--output-len", str(args.output_len), "--num-requests", str(args.num_requests),
        "--concurrency", str(args.concurrency), "--output-dir", str(out), "--no-progress",
        "--seed", "1",
    ]
    subprocess.run(cmd, check=True, capture_output=True, text=True, env=cpu_env())
    row = json.loads((out / "summary.json").read_text())
    return {"output_throughput": row["output_throughput"], "median_ttft_ms": row["median_ttft_ms"],
            "completed": row["completed"], "total_input_tokens": row["total_input_tokens"],
            "total_output_tokens": row["total_output_tokens"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=ROOT / ".cache/models/SmolLM2-135M-Instruct")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--reanalyze", type=Path, default=None,
                        help="recompute the figures from the runs recorded in this results file")
    args = parser.parse_args()
    if args.reanalyze is not None:
        recorded = json.loads(args.reanalyze.read_text())
        return report(recorded["config"], recorded["runs"])
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    RESULTS.mkdir(parents=True, exist_ok=True)
    port = free_port()
    runs: dict[str, list[dict]] = {"sglang.benchmark.serving": [], "omniinfer bench": []}
    with tempfile.TemporaryDirectory() as tmp, SGLangServer(
        cpu_server_command(args.model, port, 16384), cpu_env(), Path(tmp) / "server.log", port
    ) as server:
        run_ours(server.base_url, args.model, args, Path(tmp) / "warmup")  # first shapes are slow
        for i in range(args.rounds):
            runs["sglang.benchmark.serving"].append(
                run_sglang_bench(server.base_url, args.model, args, Path(tmp) / f"sglang{i}.jsonl"))
            runs["omniinfer bench"].append(run_ours(server.base_url, args.model, args, Path(tmp) / f"ours{i}"))
            print(f"round {i + 1}/{args.rounds}: sglang {runs['sglang.benchmark.serving'][-1]} | "
                  f"ours {runs['omniinfer bench'][-1]}", flush=True)
    config = {k: (v.name if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "reanalyze"}
    return report(config, runs)


def report(config: dict, runs: dict[str, list[dict]]) -> int:
    keys = ("output_throughput", "median_ttft_ms")
    ours_runs, peer_runs = runs["omniinfer bench"], runs["sglang.benchmark.serving"]
    med = {tool: {k: statistics.median(r[k] for r in rows) for k in keys} for tool, rows in runs.items()}
    paired = {k: [o[k] / p[k] for o, p in zip(ours_runs, peer_runs, strict=True)] for k in keys}
    ratio = {k: statistics.median(v) for k, v in paired.items()}
    print(f"\n{'metric':<22}{'sglang.benchmark':>18}{'omniinfer bench':>17}{'paired ratios':>24}{'median':>8}")
    for k in keys:
        rounds = " ".join(f"{x:.3f}" for x in paired[k])
        print(f"{k:<22}{med['sglang.benchmark.serving'][k]:>18.2f}{med['omniinfer bench'][k]:>17.2f}"
              f"{rounds:>24}{ratio[k]:>8.3f}")
    within = all(abs(r - 1.0) <= 0.10 for r in ratio.values())
    print(f"agree within 10% (median paired ratio): {within}")
    result = {"config": config, "runs": runs, "median": med, "paired_ratios_ours_over_sglang": paired,
              "ratio_ours_over_sglang": ratio, "within_10_percent": within,
              "load_average_at_end": os.getloadavg()}
    (RESULTS / "compare_sglang_bench.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {RESULTS / 'compare_sglang_bench.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
