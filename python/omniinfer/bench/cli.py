"""``omniinfer bench``: closed-loop or trace-replay benchmark of an SGLang-protocol server."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from omniinfer.bench.client import BACKENDS, RequestResult
from omniinfer.bench.metrics import format_table, summarize
from omniinfer.bench.prefix_workloads import PREFIX_WORKLOADS
from omniinfer.bench.runner import (
    TargetUnreachable,
    check_reachable,
    run_closed_loop,
    run_trace_replay,
)
from omniinfer.bench.workloads import (
    TEXT_WORKLOADS,
    TRACE_WORKLOADS,
    WORKLOADS,
    BenchRequest,
    TraceError,
    WorkloadSpec,
    describe,
    poisson_arrivals,
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench",
        help="closed-loop or trace-replay benchmark of a running server",
        description="Closed loop: --concurrency N keeps N requests in flight (when one finishes, "
        "the next starts). Trace replay: --replay sends each request at its trace time. Open "
        "loop: --request-rate R sends requests at Poisson times, R per second. Later turns of "
        "multi-turn chats wait for the previous turn's answer in every mode.",
    )
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--backend", choices=sorted(BACKENDS), default="sglang",
                   help="sglang: /generate; openai: /v1/completions; openai-chat: /v1/chat/completions")
    p.add_argument("--tokenizer", help="served model or tokenizer folder (vocabulary, chat text)")
    p.add_argument("--workload", default="random",
                   choices=sorted(WORKLOADS) + sorted(TEXT_WORKLOADS) + sorted(PREFIX_WORKLOADS),
                   help="prefix-groups and multi-turn cut prompts from real text with "
                   "--tokenizer (random ids without one)")
    p.add_argument("--trace", type=Path, help="trace file for mooncake/azure (default: the shipped one)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--duration", type=float, default=None, help="closed loop: stop issuing after S seconds")
    p.add_argument("--replay", action="store_true", help="open loop: honour the trace timestamps")
    p.add_argument("--request-rate", type=float, default=None,
                   help="open loop: Poisson arrivals at this many requests per second (replaces "
                   "trace timestamps; multi-turn: conversations start at rate / turns)")
    p.add_argument("--time-scale", type=float, default=1.0, help="replay: 0.1 = ten times faster")
    p.add_argument("--max-concurrency", type=int, default=None, help="replay: cap requests in flight")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--range-ratio", type=float, default=1.0)
    p.add_argument("--input-scale", type=float, default=1.0, help="multiply trace/paper input lengths")
    p.add_argument("--output-scale", type=float, default=1.0, help="multiply trace/paper output lengths")
    p.add_argument("--max-total-len", type=int, default=None, help="clip input+output to this")
    p.add_argument("--prefix-len", type=int, default=512,
                   help="shared-prefix, prefix-groups: tokens of each group's shared prefix")
    p.add_argument("--num-groups", type=int, default=8,
                   help="shared-prefix, prefix-groups: distinct prefixes")
    p.add_argument("--users-per-group", type=int, default=5,
                   help="prefix-groups: users per group; each round, every user sends a query "
                   "(default --num-requests: one round)")
    p.add_argument("--query-len", type=int, default=128,
                   help="prefix-groups: tokens of the fresh query after the prefix")
    p.add_argument("--conversations", type=int, default=16, help="multi-turn: chats")
    p.add_argument("--turns", type=int, default=4, help="multi-turn: turns per chat")
    p.add_argument("--turn-len", type=int, default=128,
                   help="multi-turn: tokens of each new user message (answers: --output-len)")
    p.add_argument("--think-time", type=float, default=0.0,
                   help="multi-turn: seconds between an answer and the next turn")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft", type=float, default=2.0, help="seconds (default 2)")
    p.add_argument("--slo-tpot", type=float, default=0.050, help="seconds (default 0.05)")
    p.add_argument("--output-dir", type=Path, default=None,
                   help="write requests.jsonl, summary.json and bench.png here")
    p.add_argument("--title", default=None)
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def _tokenizer(path: str | None) -> Any:
    if path is None:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def build_requests(args: argparse.Namespace, tokenizer: Any) -> list[BenchRequest]:
    vocab, special = 32000, frozenset()
    if tokenizer is not None:
        vocab = len(tokenizer)
        special = frozenset(int(i) for i in tokenizer.all_special_ids)
    spec = WorkloadSpec(
        num_requests=args.num_requests, input_len=args.input_len, output_len=args.output_len,
        range_ratio=args.range_ratio, seed=args.seed, trace=args.trace,
        input_scale=args.input_scale, output_scale=args.output_scale,
        prefix_len=args.prefix_len, num_groups=args.num_groups, vocab_size=vocab,
        special_ids=special, max_total_len=args.max_total_len,
        users_per_group=args.users_per_group, query_len=args.query_len,
        conversations=args.conversations, turns=args.turns, turn_len=args.turn_len,
        think_s=args.think_time,
    )
    requests = _build(args, spec, tokenizer)
    if args.request_rate is not None:
        requests = poisson_arrivals(requests, args.request_rate, args.seed)
    return requests


def _build(args: argparse.Namespace, spec: WorkloadSpec, tokenizer: Any) -> list[BenchRequest]:
    if args.workload in PREFIX_WORKLOADS:
        if tokenizer is None:
            print("omniinfer bench: no --tokenizer, prompts are random ids, not text",
                  file=sys.stderr)
        return PREFIX_WORKLOADS[args.workload](spec, tokenizer)
    if args.workload in TEXT_WORKLOADS:
        if tokenizer is None:
            raise ValueError(f"--workload {args.workload} needs --tokenizer")
        return TEXT_WORKLOADS[args.workload](spec, tokenizer)
    if tokenizer is None and args.workload not in TRACE_WORKLOADS:
        print("omniinfer bench: no --tokenizer, drawing ids from a 32000-token vocabulary",
              file=sys.stderr)
    return WORKLOADS[args.workload](spec)


def prompt_text_for(tokenizer: Any):  # type: ignore[no-untyped-def]
    def text(request: BenchRequest) -> str:
        if request.prompt is not None:
            return request.prompt
        if tokenizer is None:
            raise ValueError("--backend openai-chat with token-id workloads needs --tokenizer")
        return str(tokenizer.decode(list(request.input_ids or ())))

    return text


def write_outputs(
    out: Path, results: list[RequestResult], summary: dict[str, Any], duration: float, title: str
) -> None:
    from omniinfer.bench.plots import plot_run

    out.mkdir(parents=True, exist_ok=True)
    with open(out / "requests.jsonl", "w") as f:
        for r in results:
            f.write(json.dumps(r.row()) + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    plot_run(results, duration, out / "bench.png", title)


def run(args: argparse.Namespace) -> int:
    try:
        open_loop = args.replay or args.request_rate is not None
        if (args.num_requests is None and args.duration is None and not open_loop
                and args.workload not in PREFIX_WORKLOADS):
            args.num_requests = 64
        tokenizer = _tokenizer(args.tokenizer)
        requests = build_requests(args, tokenizer)
        asyncio.run(check_reachable(args.base_url))
    except (TraceError, ValueError, TargetUnreachable, OSError) as exc:
        print(f"omniinfer: error: {exc}", file=sys.stderr)
        return 2
    title = args.title or f"{args.workload} on {args.base_url} ({args.backend})"
    text = prompt_text_for(tokenizer)
    progress = not args.no_progress
    if open_loop:
        results, duration = asyncio.run(run_trace_replay(
            args.base_url, requests, args.time_scale, args.backend, text, args.max_concurrency,
            progress=progress))
    else:
        results, duration = asyncio.run(run_closed_loop(
            args.base_url, requests, args.concurrency, args.backend, text, args.duration,
            progress=progress))
    summary: dict[str, Any] = summarize(results, duration, args.slo_ttft, args.slo_tpot)
    summary.update(
        workload=args.workload, backend=args.backend, mode="replay" if open_loop else "closed",
        concurrency=None if open_loop else args.concurrency, request_rate=args.request_rate,
        time_scale=args.time_scale if open_loop else None, workload_stats=describe(requests),
    )
    print(format_table(summary, title))
    for r in [r for r in results if not r.ok][:5]:
        print(f"request {r.index} failed: {r.error}", file=sys.stderr)
    if args.output_dir is not None:
        write_outputs(args.output_dir, results, summary, duration, title)
        print(f"wrote {args.output_dir}/summary.json, requests.jsonl, bench.png")
    return 0 if summary["errors"] == 0 else 1
