"""The end-to-end demo: the whole system this project is for, on this CPU.

It starts the deployment file ``deploy/omni-1p1d-cpu.yaml`` (or ``--deployment FILE``) exactly
as ``omniinfer deploy`` does: one prefill and one decode real SGLang server with the plugin on
SmolLM2-MoE, two expert-parallel ranks each, the OmniAttn pattern and the OmniPlacement
controller on both, KV over Mooncake's TCP transport, and OmniProxy with OAS in front in PD
mode. Then one chat answer, a closed-loop benchmark table, and a line per technique read from
the servers' and the router's own reports: the decode server's compressed KV and the transfer's
saving, the placement imbalance before and after and the migrations adopted, OAS's decisions.

Every process it starts runs in its own process group and is stopped on exit, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
import urllib.request
from pathlib import Path

from omniinfer.bench.metrics import format_table, summarize
from omniinfer.bench.runner import run_closed_loop
from omniinfer.bench.workloads import WorkloadSpec, text_corpus

DEPLOYMENT = Path("deploy") / "omni-1p1d-cpu.yaml"
QUESTION = "What is the capital of France? Answer in one short sentence."


def chat(base_url: str, question: str, max_tokens: int = 48) -> str:
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
    }
    request = urllib.request.Request(
        f"{base_url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        reply = json.loads(response.read())
    return str(reply["choices"][0]["message"]["content"]).strip()


def _exit_on_sigterm(*_args: object) -> None:
    raise SystemExit(143)  # unwinds the context managers, which stop every process


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--deployment", type=Path, default=DEPLOYMENT,
                        help="the deployment file to start (default: %(default)s)")
    parser.add_argument("--output-dir", type=Path, default=Path("demo-output"))
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--num-requests", type=int, default=12)
    parser.add_argument("--input-len", type=int, default=1024,
                        help="prompt tokens (over the pattern's sink + window, so it evicts)")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--slo-ttft", type=float, default=30.0,
                        help="goodput objective, seconds (the paper's 2 s is for accelerators; "
                        "a 1K-token prefill on this CPU takes seconds)")
    parser.add_argument("--slo-tpot", type=float, default=1.0,
                        help="goodput objective, seconds per output token (paper: 0.05)")
    args = parser.parse_args(argv)

    from omniinfer.demo_report import attn_lines, oas_lines, placement_lines
    from omniinfer.deploy.local import Local
    from omniinfer.deploy.spec import DeployError, load
    from omniinfer.launch import free_port

    try:
        dep = load(args.deployment)
    except DeployError as exc:
        print(f"[demo] {exc}", file=sys.stderr)
        return 2
    args.model = Path(dep.model)
    system = Local(dep, args.output_dir, router_port=free_port())
    print(f"[demo] starting {args.deployment}: {dep.prefill.count} prefill and "
          f"{dep.decode.count} decode SGLang server(s) on {args.model.name}, OmniProxy "
          f"{dep.router.prefill_policy} in front; logs in {args.output_dir}", flush=True)
    began = time.monotonic()
    with system.started():
        print(f"[demo] ready in {time.monotonic() - began:.0f} s")
        for line in system.describe():
            print(f"[demo]   {line}")
        print(f"[demo] OmniProxy ({dep.router.prefill_policy}, PD mode) in front at "
              f"{system.router.base_url}", flush=True)
        failed = _ask_and_benchmark(system.router.base_url, args)
        prefill = next(p.base_url for s, p in system.servers if s.role == "prefill")
        decode = next(p.base_url for s, p in system.servers if s.role == "decode")
        for line in [*attn_lines(prefill, decode), *placement_lines(decode),
                     *oas_lines(system.router.base_url)]:
            print(f"[demo] {line}")
    print("[demo] servers and router stopped")
    return 1 if failed else 0


def _ask_and_benchmark(base_url: str, args: argparse.Namespace) -> list[object]:
    """One chat answer, then the closed-loop benchmark table, both through ``base_url``."""
    from transformers import AutoTokenizer

    print(f"[demo] Q: {QUESTION}")
    print(f"[demo] A: {chat(base_url, QUESTION)}")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    requests = text_corpus(WorkloadSpec(args.num_requests, args.input_len, args.output_len), tokenizer)
    # The first batches of a new shape are slow on the CPU engine; warm up before measuring.
    warmup = text_corpus(WorkloadSpec(args.concurrency, args.input_len, 4, seed=1), tokenizer)
    asyncio.run(run_closed_loop(base_url, warmup, args.concurrency, progress=False))
    print(
        f"[demo] closed loop: {args.num_requests} requests, concurrency {args.concurrency}, "
        f"{args.input_len} tokens in / {args.output_len} out"
    )
    results, duration = asyncio.run(run_closed_loop(base_url, requests, args.concurrency))
    summary = summarize(results, duration, args.slo_ttft, args.slo_tpot)
    summary["concurrency"] = args.concurrency
    print(format_table(summary, f"SGLang PD on CPU via OmniProxy, {args.model.name}"))
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "bench-summary.json").write_text(json.dumps(summary, indent=2))
    failed = [r for r in results if not r.ok]
    for r in failed[:3]:
        print(f"[demo] request {r.index} failed: {r.error}", file=sys.stderr)
    return failed


if __name__ == "__main__":
    raise SystemExit(main())
