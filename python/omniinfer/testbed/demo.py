"""The end-to-end demo: the whole system this project is for, on this CPU.

It starts the deployment file ``deploy/omni-1p1d-cpu.yaml`` (or ``--deployment FILE``) exactly
as ``omniinfer deploy`` does: one prefill and one decode real SGLang server with the plugin on
SmolLM2-MoE, two expert-parallel ranks each, the OmniAttn pattern and the OmniPlacement
controller on both, KV over Mooncake's TCP transport, and OmniProxy with OAS in front in PD
mode. Then one chat answer, a closed-loop benchmark table, and a line per technique read from
the servers' and the router's own reports: the decode server's compressed KV and the transfer's
saving, the placement imbalance before and after and the migrations adopted, OAS's decisions.

Every process it starts runs in its own process group and is stopped on exit, also on Ctrl-C.
With ``--attach ROUTER_URL`` it starts nothing: the answer, the table and the lines run against
a system already serving (``omniinfer deploy FILE``; ``--deployment`` then names that file, for
its model's tokenizer), whose prefill and decode servers are read from the router's
``/list_workers``; the system is left running.
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
MAX_WORKER_LIST_BYTES = 1 << 20  # /list_workers of a 1P1D system is about 1 KiB


def attached_servers(router_url: str) -> tuple[str, str]:
    """(prefill URL, decode URL): the first of each role in the router's ``/list_workers``.
    Raises ValueError naming what is wrong when the answer is too large, not JSON, or lacks a
    prefill or a decode worker with an ``http(s)://`` URL."""
    with urllib.request.urlopen(f"{router_url}/list_workers", timeout=30) as response:
        raw = response.read(MAX_WORKER_LIST_BYTES + 1)
    if len(raw) > MAX_WORKER_LIST_BYTES:
        raise ValueError(f"{router_url}/list_workers answered more than "
                         f"{MAX_WORKER_LIST_BYTES} bytes")
    try:
        described = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"{router_url}/list_workers is not JSON: {exc}") from None
    workers = described.get("workers") if isinstance(described, dict) else described
    found: dict[str, str] = {}
    for worker in workers if isinstance(workers, list) else []:
        if not isinstance(worker, dict):
            continue
        url, role = worker.get("url"), worker.get("role")
        if (isinstance(url, str) and url.startswith(("http://", "https://"))
                and role in ("prefill", "decode")):
            found.setdefault(role, url.rstrip("/"))
    missing = [role for role in ("prefill", "decode") if role not in found]
    if missing:
        raise ValueError(f"{router_url}/list_workers names no {' and no '.join(missing)} "
                         "server: --attach needs a PD system")
    return found["prefill"], found["decode"]


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
    parser.add_argument("--attach", metavar="ROUTER_URL",
                        help="start nothing: run against the system this OmniProxy fronts "
                        "(started by `omniinfer deploy FILE`) and leave it running")
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

    from omniinfer.child_process import free_port
    from omniinfer.deploy.local import Local
    from omniinfer.deploy.spec import DeployError, load

    try:
        dep = load(args.deployment)
    except DeployError as exc:
        print(f"[demo] {exc}", file=sys.stderr)
        return 2
    args.model = Path(dep.model)
    if args.attach:
        return _attached(args.attach.rstrip("/"), dep.router.prefill_policy, args)
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
        prefill = next(p.base_url for s, p in system.servers if s.role == "prefill")
        decode = next(p.base_url for s, p in system.servers if s.role == "decode")
        failed = _ask_benchmark_and_report(system.router.base_url, prefill, decode, args)
    print("[demo] servers and router stopped")
    return 1 if failed else 0


def _attached(router_url: str, policy: str, args: argparse.Namespace) -> int:
    """The demo against a system already serving behind ``router_url``; nothing is stopped."""
    try:
        prefill, decode = attached_servers(router_url)
    except (ValueError, OSError) as exc:
        print(f"[demo] --attach: {exc}", file=sys.stderr)
        return 2
    print(f"[demo] attached to OmniProxy ({policy}, PD mode) in front at {router_url}: "
          f"prefill {prefill}, decode {decode}", flush=True)
    failed = _ask_benchmark_and_report(router_url, prefill, decode, args)
    print("[demo] attached system left running")
    return 1 if failed else 0


def _ask_benchmark_and_report(router_url: str, prefill: str, decode: str,
                              args: argparse.Namespace) -> list[object]:
    """The answer and the table through the router, then a line per technique."""
    from omniinfer.testbed.demo_report import attn_lines, oas_lines, placement_lines

    failed = _ask_and_benchmark(router_url, args)
    for line in [*attn_lines(prefill, decode), *placement_lines(decode), *oas_lines(router_url)]:
        print(f"[demo] {line}")
    return failed


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
