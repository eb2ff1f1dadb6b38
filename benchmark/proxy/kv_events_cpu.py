"""CPU cost of following KV events in the router (``--cache-truth kv-events``).

Two measurements, both in CPU time (robust on a shared machine, unlike wall time):

``micro`` (default, no processes): the emulator's own radix cache (token pages, as SGLang on
CPU and the emulator publish them) stores and evicts a stream of prompts — unique ones like the
paper mix and group-shared ones — and its events are encoded as on the wire; then the router's
path for them, ``decode_batch`` and ``WorkerCacheTruth.apply``, is timed alone. Reports CPU
microseconds per batch, per event and per prompt token.

``router``: an emulated PD cluster whose workers publish KV events; one OmniProxy per cache
truth (``router``, ``kv-events``) takes the same open-loop paper mix; the router process's own
CPU seconds (user + system, from /proc) per request are compared. ``--profile DIR`` runs each
router under cProfile and prints its top functions.

    python benchmark/proxy/kv_events_cpu.py                       # micro, seconds
    python benchmark/proxy/kv_events_cpu.py --mode router --qpm 1200 --requests 240
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pstats
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from omniinfer.emulator.kv_event_publisher import KvEventRecorder
from omniinfer.emulator.radix_cache import RadixCache
from omniinfer.kv_event_wire import decode_batch, encode_batch
from omniinfer.proxy.prefix import PrefixIndex
from omniinfer.proxy.worker_cache_truth import WorkerCacheTruth

HERE = Path(__file__).resolve().parent


def event_stream(prompts: int, prompt_tokens: int, shared_share: float, capacity: int,
                 seed: int) -> tuple[list[bytes], int, int]:
    """Wire payloads of a radix cache of ``capacity`` tokens taking ``prompts`` prompts; returns
    (payloads, prompt tokens, events)."""
    rng = random.Random(seed)
    recorder = KvEventRecorder()
    tree = RadixCache(capacity=capacity)
    tree.attach_events(recorder)
    groups = [[rng.randrange(50_000) for _ in range(prompt_tokens * 2 // 3)] for _ in range(16)]
    payloads, tokens, events = [], 0, 0
    for _ in range(prompts):
        if rng.random() < shared_share:
            ids = rng.choice(groups) + [rng.randrange(50_000) for _ in range(prompt_tokens // 3)]
        else:
            ids = [rng.randrange(50_000) for _ in range(prompt_tokens)]
        tokens += len(ids)
        tree.insert(ids)
        batch = recorder.take()
        events += len(batch)
        payloads.append(encode_batch(time.time(), batch))
    return payloads, tokens, events


def micro(args: argparse.Namespace) -> dict[str, Any]:
    payloads, tokens, events = event_stream(args.prompts, args.prompt_tokens, args.shared_share,
                                            args.capacity, args.seed)
    runs = []
    for _ in range(args.repeats):
        truth = WorkerCacheTruth("w", PrefixIndex(), args.block_size)
        t0 = time.process_time()
        batches = [decode_batch(p) for p in payloads]
        t1 = time.process_time()
        for batch in batches:
            truth.apply(0, batch)
        t2 = time.process_time()
        runs.append((t1 - t0, t2 - t1))
    decode = statistics.median(r[0] for r in runs)
    apply = statistics.median(r[1] for r in runs)
    out = {"batches": len(payloads), "events": events, "prompt_tokens": tokens,
           "payload_bytes": sum(map(len, payloads)), "repeats": args.repeats,
           "decode_us_per_batch": 1e6 * decode / len(payloads),
           "apply_us_per_batch": 1e6 * apply / len(payloads),
           "us_per_event": 1e6 * (decode + apply) / max(1, events),
           "us_per_prompt_token": 1e6 * (decode + apply) / tokens}
    print(f"{len(payloads)} batches ({events} events, {tokens:,} prompt tokens, "
          f"{out['payload_bytes'] / 1e6:.1f} MB), median of {args.repeats}: decode "
          f"{out['decode_us_per_batch']:.0f} us/batch, apply {out['apply_us_per_batch']:.0f} "
          f"us/batch; {out['us_per_event']:.0f} us/event, {out['us_per_prompt_token']:.3f} "
          "us/prompt token (CPU time)")
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def router_run(args: argparse.Namespace) -> dict[str, Any]:
    from cluster import (
        EmulatedCluster,
        free_port,
        omni_router_args,
        omni_router_command,
        start_router,
    )

    from omniinfer.bench.runner import run_trace_replay
    from omniinfer.bench.workloads import WorkloadSpec, paper, poisson_arrivals

    spec = WorkloadSpec(num_requests=args.requests, seed=args.seed, vocab_size=128000,
                        output_scale=0.05, max_total_len=8000)
    requests = poisson_arrivals(paper(spec), args.qpm / 60.0, args.seed)
    logs = Path(tempfile.mkdtemp(prefix="kv_events_cpu_"))
    cluster = EmulatedCluster(args.prefill, 1, "h100-llama3-8b", args.time_scale, logs,
                              kv_events=True)
    out: dict[str, Any] = {}
    try:
        for repeat in range(args.repeats):
            for truth in ("router", "kv-events"):
                cluster.flush()
                port = free_port()
                command = omni_router_command(omni_router_args(
                    cluster, args.policy, args.policy, None, truth), port)
                if args.profile is not None:
                    args.profile.mkdir(parents=True, exist_ok=True)
                    prof = args.profile / f"{truth}.prof"
                    command = [command[0], "-m", "cProfile", "-o", str(prof), *command[1:]]
                router = start_router(command, port, logs / f"router-{truth}.log")
                try:
                    assert router.process is not None
                    pid = router.process.pid
                    before = cpu_seconds(pid)
                    results, wall = asyncio.run(run_trace_replay(
                        f"http://127.0.0.1:{port}", requests, args.time_scale, progress=False,
                        timeout_s=600))
                    used = cpu_seconds(pid) - before
                finally:
                    router.stop()
                ok = sum(1 for r in results if r.ok)
                row = {"cpu_s": used, "requests": ok, "wall_s": wall,
                       "cpu_ms_per_request": 1e3 * used / max(1, ok),
                       "cpu_share_of_one_core": used / wall}
                out.setdefault(truth, []).append(row)
                print(f"  repeat {repeat} {truth:9s}: router CPU {used:.2f} s for {ok} requests "
                      f"= {row['cpu_ms_per_request']:.2f} ms/request "
                      f"({row['cpu_share_of_one_core']:.0%} of a core over {wall:.0f} s)",
                      flush=True)
                if args.profile is not None and prof.exists():
                    pstats.Stats(str(prof)).sort_stats("tottime").print_stats(12)
    finally:
        cluster.stop()
    for truth, rows in list(out.items()):
        out[f"{truth}_median_cpu_ms_per_request"] = statistics.median(
            r["cpu_ms_per_request"] for r in rows)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("micro", "router"), default="micro")
    p.add_argument("--prompts", type=int, default=400, help="micro: prompts stored")
    p.add_argument("--prompt-tokens", type=int, default=3000)
    p.add_argument("--shared-share", type=float, default=0.5,
                   help="micro: share of prompts that extend one of 16 shared prefixes")
    p.add_argument("--capacity", type=int, default=60_000, help="micro: cache tokens (evicts)")
    p.add_argument("--block-size", type=int, default=16, help="the router's block")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prefill", type=int, default=2, help="router: prefill emulators (1 decode)")
    p.add_argument("--policy", default="oas")
    p.add_argument("--qpm", type=float, default=900.0, help="router: model requests per minute")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--time-scale", type=float, default=2.0)
    p.add_argument("--profile", type=Path, default=None, help="router: cProfile output folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, default=None, help="write the figures as JSON here")
    args = p.parse_args()
    result = micro(args) if args.mode == "micro" else router_run(args)
    result["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    if args.output is not None:
        args.output.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
