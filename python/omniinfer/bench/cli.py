"""``omniinfer bench``: a closed-loop benchmark against an SGLang-protocol server."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from omniinfer.bench.metrics import format_table, summarize
from omniinfer.bench.runner import run_closed_loop
from omniinfer.bench.workloads import WORKLOADS


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="closed-loop benchmark of a running server")
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--tokenizer", required=True, help="model or tokenizer folder of the served model")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="random")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--range-ratio", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft", type=float, default=2.0, help="seconds")
    p.add_argument("--slo-tpot", type=float, default=0.050, help="seconds")
    p.add_argument("--output-dir", type=Path, default=None, help="write requests.jsonl and summary.json here")
    p.add_argument("--title", default="Closed-loop benchmark")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    requests = WORKLOADS[args.workload](
        tokenizer, args.num_requests, args.input_len, args.output_len, args.range_ratio, args.seed
    )
    results, duration = asyncio.run(
        run_closed_loop(args.base_url, requests, args.concurrency, progress=not args.no_progress)
    )
    summary = summarize(results, duration, args.slo_ttft, args.slo_tpot)
    summary["concurrency"] = args.concurrency
    print(format_table(summary, args.title))
    errors = [r for r in results if not r.ok]
    for r in errors[:5]:
        print(f"request {r.index} failed: {r.error}")
    if args.output_dir is not None:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        with open(args.output_dir / "requests.jsonl", "w") as f:
            for r in results:
                f.write(json.dumps(r.row()) + "\n")
        (args.output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        print(f"wrote {args.output_dir / 'summary.json'}")
    return 0 if not errors else 1
