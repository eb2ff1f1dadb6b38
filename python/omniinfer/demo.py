"""The end-to-end demo: the deployment this project is for, on this CPU.

One prefill and one decode real SGLang server with the plugin (KV over Mooncake's TCP transport),
both with the OmniAttn pattern, OmniProxy with OAS in front of them in PD mode: one chat answer,
a closed-loop benchmark, and a line per technique (the decode server's compressed KV, the
transferred bytes saved, OAS's routing decisions). Then OmniPlacement under PD: a Qwen3-MoE
prefill and decode pair with expert parallelism over two ranks each and the placement controller
on (a tiny random model: SmolLM2's attention does not split over two ranks on the CPU engine),
with its layers' imbalance before and after and the migrations adopted.

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
from omniinfer.launch_pd import pd_server, router_args, started
from omniinfer.proxy.process import RouterProcess

PATTERN = Path(__file__).resolve().parent / "attn" / "patterns" / "smollm2-135m.json"
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
    parser.add_argument("--policy", default="oas", help="OmniProxy prefill and decode policy")
    parser.add_argument("--pattern", type=Path, default=PATTERN,
                        help="OmniAttn pattern of both servers ('none': no pattern)")
    parser.add_argument("--no-placement", action="store_true",
                        help="skip the OmniPlacement stage")
    args = parser.parse_args(argv)

    logs = args.output_dir
    omni = [] if str(args.pattern) == "none" else ["--omni-attn-pattern", str(args.pattern)]
    servers = [pd_server(args.model, "prefill", logs, args.max_total_tokens, omni),
               pd_server(args.model, "decode", logs, args.max_total_tokens, omni)]
    print(f"[demo] starting one prefill and one decode SGLang server on {args.model.name} "
          f"(CPU engine, plugin loaded, KV over Mooncake TCP); logs in {logs}")
    began = time.monotonic()
    with started(servers):
        prefill, decode = servers
        print(f"[demo] servers ready in {time.monotonic() - began:.0f} s: prefill "
              f"{prefill.base_url} (bootstrap port {prefill.bootstrap_port}), decode {decode.base_url}")
        router_log = logs / "omniproxy.log"
        router = RouterProcess(
            [*router_args(servers), "--prefill-policy", args.policy, "--decode-policy",
             args.policy if args.policy.startswith("oas") else "round_robin",
             "--model-path", str(args.model)], router_log)
        with router:
            print(f"[demo] OmniProxy ({args.policy}, PD mode) in front of them at "
                  f"{router.base_url}; log: {router_log}")
            failed = _ask_and_benchmark(router.base_url, args)
            from omniinfer.demo_report import attn_lines, oas_lines

            for line in [*attn_lines(prefill.base_url, decode.base_url),
                         *oas_lines(router.base_url)]:
                print(f"[demo] {line}")
    print("[demo] servers and router stopped")
    if not args.no_placement:
        from omniinfer.demo_report import placement_stage

        for line in placement_stage(logs, args.policy):
            print(f"[demo] {line}")
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
    print(format_table(summary, f"SGLang 1P1D on CPU via OmniProxy, {args.model.name}"))
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "bench-summary.json").write_text(json.dumps(summary, indent=2))
    failed = [r for r in results if not r.ok]
    for r in failed[:3]:
        print(f"[demo] request {r.index} failed: {r.error}", file=sys.stderr)
    return failed


if __name__ == "__main__":
    raise SystemExit(main())
