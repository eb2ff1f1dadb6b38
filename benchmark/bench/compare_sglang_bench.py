"""omniinfer bench vs SGLang's own `python -m sglang.benchmark.serving`, same server, same run.

Both tools drive the same real SGLang CPU server with the same workload shape (random token ids,
fixed input/output lengths, ignore_eos, closed loop at the same concurrency). The runs alternate
(sglang, ours, sglang, ours, ...) so drift of the shared machine hits both; the script prints the
median over rounds of output throughput and median TTFT for each tool and their ratio, and
writes results/compare_sglang_bench.json.

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

from omniinfer.launch import SGLangServer, cpu_env, cpu_server_command, free_port

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
    ]
    subprocess.run(cmd, check=True, capture_output=True, text=True, env=cpu_env())
    row = json.loads(out.read_text().strip().splitlines()[-1])
    return {"output_throughput": row["output_throughput"], "median_ttft_ms": row["median_ttft_ms"],
            "completed": row["completed"]}


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
            "completed": row["completed"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=ROOT / ".cache/models/SmolLM2-135M-Instruct")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    args = parser.parse_args()
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
    med = {tool: {k: statistics.median(r[k] for r in rows) for k in ("output_throughput", "median_ttft_ms")}
           for tool, rows in runs.items()}
    ours, peer = med["omniinfer bench"], med["sglang.benchmark.serving"]
    ratio = {k: ours[k] / peer[k] for k in ours}
    print(f"\n{'metric':<28}{'sglang.benchmark':>18}{'omniinfer bench':>18}{'ratio':>8}")
    for k in ("output_throughput", "median_ttft_ms"):
        print(f"{k:<28}{peer[k]:>18.2f}{ours[k]:>18.2f}{ratio[k]:>8.3f}")
    within = all(abs(r - 1.0) <= 0.10 for r in ratio.values())
    print(f"agree within 10%: {within}")
    result = {"config": vars(args) | {"model": args.model.name}, "runs": runs, "median": med,
              "ratio_ours_over_sglang": ratio, "within_10_percent": within}
    (RESULTS / "compare_sglang_bench.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {RESULTS / 'compare_sglang_bench.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
