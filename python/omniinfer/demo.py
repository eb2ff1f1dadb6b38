"""The end-to-end demo: the real SGLang with the plugin, OmniProxy in front, a chat answer, a benchmark.

Every process it starts runs in one process group that is stopped on exit, also on Ctrl-C.
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
from omniinfer.launch import SGLangServer, cpu_env, cpu_server_command, free_port
from omniinfer.proxy.process import RouterProcess

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
    raise SystemExit(143)  # unwinds the context managers, which stop the server


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--output-dir", type=Path, default=Path("demo-output"))
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-total-tokens", type=int, default=16384)
    args = parser.parse_args(argv)

    port = free_port()
    command = cpu_server_command(args.model, port, args.max_total_tokens)
    log = args.output_dir / "sglang-server.log"
    print(f"[demo] starting SGLang on {args.model.name} (CPU engine, plugin loaded); log: {log}")
    started = time.monotonic()
    with SGLangServer(command, cpu_env(), log, port) as server:
        print(f"[demo] server ready in {time.monotonic() - started:.0f} s at {server.base_url}")
        router_log = args.output_dir / "omniproxy.log"
        router = RouterProcess(
            ["--worker-urls", server.base_url, "--policy", "cache_aware",
             "--model-path", str(args.model)], router_log)
        with router:
            print(f"[demo] OmniProxy (cache_aware) in front of it at {router.base_url}; log: {router_log}")
            failed = _ask_and_benchmark(router.base_url, args)
    print("[demo] server and router stopped")
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
    summary = summarize(results, duration)
    summary["concurrency"] = args.concurrency
    print(format_table(summary, f"SGLang on CPU via OmniProxy, {args.model.name}"))
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "bench-summary.json").write_text(json.dumps(summary, indent=2))
    failed = [r for r in results if not r.ok]
    for r in failed[:3]:
        print(f"[demo] request {r.index} failed: {r.error}", file=sys.stderr)
    return failed


if __name__ == "__main__":
    raise SystemExit(main())
