"""OmniProxy OAS against the upstream Rust router (smg) on emulated PD clusters, in one run.

For each cluster (2P1D and 4P1D emulated ``h100-llama3-8b`` workers at ``--time-scale``) and
each router — OmniProxy with ``oas``, ``omni_default``, ``omni_earliest_batch`` (and the OAS
ablations on 4P1D), and the peer (``--peer``): smg 1.13 with each of its policies that apply
(targets ``smg:round_robin``, ``smg:power_of_two``, ``smg:cache_aware``, ``smg:least_load``,
``smg:prefix_hash``, ``smg:consistent_hashing``, ``smg:bucket``), or ``--peer sglang-router``:
``sglang_router`` 0.3.2 with ``round_robin``, ``cache_aware`` and ``power_of_two`` (targets
``sglang:POLICY``; the decode side of a pair is round_robin over one decode worker, and for
bucket) — it runs the ``paper`` workload closed-loop at each concurrency of the sweep,
the same mix open-loop at a fixed Poisson rate (``--open-qpm``: tail latency at equal QPM) and
the Mooncake conversation trace open-loop, with the prefix caches flushed before each run.
Times are converted back to model seconds (divided by the time scale) before the SLO
(TTFT < 2 s, TPOT < 50 ms) is applied; OmniProxy is told the same TTFT objective
(``--oas-ttft-slo-secs``, in wall seconds) unless ``--no-router-slo``. Beside smg both
routers poll worker loads every ``--poll-secs`` (default 1 s: smg's --load-monitor-interval and
OmniProxy's --loads-poll-interval-secs); beside sglang-router OmniProxy polls every 0.5 s.
``--repeats N`` runs every point N times, interleaved, and the report gives medians, spreads
and per-repeat paired ratios.
``--cache-truth kv-events`` (or ``both``) also runs our policies with the prefix index driven by
the emulators' KV events (target ``omni:oas@kv-events``); every OmniProxy run records how often
its predicted cached tokens matched what the prefill worker reported, and why its prefill policy
released each request (``open``, ``idle``, ``starved``, ``overdue``). Writes ``results.json``,
``goodput.png`` and ``ttft_cdf.png`` to ``--output-dir`` and prints the tables.

    python benchmark/proxy/oas_eval.py --quick          # a few minutes, smg as the peer
    python benchmark/proxy/oas_eval.py                  # both clusters, one repeat
    # the 4P1D tables measured against sglang-router 0.3.2:
    python benchmark/proxy/oas_eval.py --peer sglang-router --clusters 4P1D --repeats 3 \
        --cache-truth both --only omni:oas,omni:oas@kv-events,omni:omni_default,\
omni:omni_earliest_batch,omni:oas_no_defer,omni:oas_no_resort,omni:oas_no_cache,\
omni:oas_no_lpt,omni:oas_no_slo,sglang:round_robin,sglang:cache_aware,sglang:power_of_two
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
from cluster import (
    EmulatedCluster,
    add_peer_args,
    free_port,
    peer_targets,
    start_router,
    target_router_command,
)
from report import write_report

from omniinfer.bench.client import RequestResult
from omniinfer.bench.metrics import summarize
from omniinfer.bench.runner import run_closed_loop, run_trace_replay
from omniinfer.bench.workloads import BenchRequest, WorkloadSpec, mooncake, paper

HERE = Path(__file__).resolve().parent

OURS = ("oas", "oas_goodput", "omni_default", "omni_earliest_batch")
ABLATIONS = ("oas_no_defer", "oas_no_resort", "oas_no_cache", "oas_no_lpt", "oas_no_slo",
             "oas_sjf", "oas_mh")  # the last two are variants (orders), not ablations
VOCAB = 128000


@dataclasses.dataclass(frozen=True)
class Target:
    name: str  # as shown in tables: "omni:oas", "omni:oas@kv-events", "smg:round_robin"
    router: str  # "omni" | "smg" | "sglang" (sglang-router)
    policy: str
    cache_truth: str = "router"  # what fills OmniProxy's prefix index
    load_feed: str = "auto"  # OmniProxy's --load-feed ("off": polls even where a feed is)


def targets(ablations: bool, truths: tuple[str, ...] = ("router",), peer: str = "smg",
            polled: bool = False) -> list[Target]:
    """Ours (per cache truth; also polling loads as ``omni:POLICY+poll`` if ``polled``), the
    ablations if asked, then the peer's policies (PD)."""
    out = [Target(f"omni:{p}" + ("" if truth == "router" else f"@{truth}"), "omni", p, truth)
           for p in OURS for truth in truths]
    if polled:
        out += [Target(f"omni:{p}+poll", "omni", p, load_feed="off") for p in OURS]
    if ablations:
        out += [Target(f"omni:{p}", "omni", p) for p in ABLATIONS]
    out += [Target(name, *name.split(":", 1)) for name in peer_targets(peer, pd=True)]
    return out


def to_model_time(results: list[RequestResult], scale: float) -> list[RequestResult]:
    out = []
    for r in results:
        out.append(dataclasses.replace(
            r, ttft=None if r.ttft is None else r.ttft / scale,
            e2e=None if r.e2e is None else r.e2e / scale, itl=[x / scale for x in r.itl],
            start=r.start / scale, end=r.end / scale))
    return out


def router_state(port: int) -> dict[str, Any]:
    """The router's own prediction counters (exact / over / under per cache truth) and its
    prefill policy's state (releases by reason: open, idle, starved, overdue)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/list_workers", timeout=10) as r:
            info = json.loads(r.read())
    except (urllib.error.URLError, OSError, ValueError):
        return {}
    prefill = (info.get("policy_state") or {}).get("prefill") or {}
    return {"cache_prediction": info.get("cache_prediction") or None,
            "released": prefill.get("released"), "max_hold_s": prefill.get("max_hold_s")}


def prediction_match(access_log: Path) -> dict[str, float] | None:
    """How often the router's predicted cached tokens equal what the prefill worker reported."""
    if not access_log.exists():
        return None
    rows = [json.loads(line) for line in access_log.read_text().splitlines() if line.strip()]
    pairs = []
    for row in rows:
        pre = [d for d in row.get("decisions", []) if d.get("role") == "prefill"]
        if pre and "reported_cached_tokens" in row:
            pairs.append((pre[-1]["cached_tokens"], row["reported_cached_tokens"]))
    if not pairs:
        return None
    block = 16
    exact = sum(1 for p, r in pairs if abs(p - r) < block)
    hits = [(p, r) for p, r in pairs if r > 0 or p > 0]
    return {"requests": len(pairs), "within_one_block": exact / len(pairs),
            "predicted_tokens": float(sum(p for p, _ in pairs)),
            "reported_tokens": float(sum(r for _, r in pairs)),
            "hit_requests": len(hits),
            "hit_within_one_block": (sum(1 for p, r in hits if abs(p - r) < block) / len(hits)
                                     if hits else 1.0)}


async def run_one(url: str, requests: list[BenchRequest], mode: str, concurrency: int,
                  replay_scale: float) -> tuple[list[RequestResult], float]:
    """Closed loop at ``concurrency``, or open loop at the requests' arrival times."""
    if mode == "closed":
        return await run_closed_loop(url, requests, concurrency, progress=False,
                                     timeout_s=600)
    return await run_trace_replay(url, requests, replay_scale, progress=False, timeout_s=600)


def steady_rates(results: list[RequestResult], slo_ttft: float, slo_tpot: float
                 ) -> dict[str, float | None]:
    """QPM and goodput QPM between the 10th and 90th percentile completion: the rate while the
    load is on, without the ramp-up and the drain of a finite run (model time)."""
    ends = sorted((r.end, r.ok and r.ttft is not None and r.ttft <= slo_ttft
                   and (r.tpot is None or r.tpot <= slo_tpot)) for r in results)
    if len(ends) < 10:
        return {"steady_qpm": None, "steady_goodput_qpm": None}
    lo, hi = ends[len(ends) // 10][0], ends[(9 * len(ends)) // 10][0]
    inside = [good for end, good in ends if lo < end <= hi]
    span = max(hi - lo, 1e-9) / 60.0
    return {"steady_qpm": len(inside) / span, "steady_goodput_qpm": sum(inside) / span}


def run_target(target: Target, cluster: EmulatedCluster, workloads: list[dict[str, Any]],
               args: argparse.Namespace, log_dir: Path) -> list[dict[str, Any]]:
    port = free_port()
    access = log_dir / f"{target.name.replace(':', '_')}.access.jsonl"
    slo = None if args.no_router_slo else args.slo_ttft * args.time_scale  # wall seconds
    command = target_router_command(target.router, target.policy, cluster, port, peer=args.peer,
                                    poll_secs=args.poll_secs, access_log=access,
                                    cache_truth=target.cache_truth, ttft_slo_secs=slo,
                                    load_feed=target.load_feed)
    rows = []
    for wl in workloads:
        cluster.flush()
        access.unlink(missing_ok=True)
        router = start_router(command, port, log_dir / f"{target.name.replace(':', '_')}.log")
        state: dict[str, Any] = {}
        busy_before = cluster.prefill_busy_s()
        try:
            results, duration = asyncio.run(run_one(
                f"http://127.0.0.1:{port}", wl["requests"], wl["mode"], wl["concurrency"],
                args.time_scale / wl.get("speedup", 1.0)))
            if target.router == "omni":
                state = router_state(port)
        finally:
            router.stop()
        busy = [b - a for a, b in zip(busy_before, cluster.prefill_busy_s(), strict=True)]
        model = to_model_time(results, args.time_scale)
        timeline = log_dir / "requests" / f"{target.name.replace(':', '_')}.{wl['name']}.c{wl['concurrency']}.json"
        timeline.parent.mkdir(parents=True, exist_ok=True)  # per request, for a closer look
        timeline.write_text(json.dumps([(r.start, r.end, r.ttft, r.prompt_tokens) for r in model]))
        summary = summarize(model, duration / args.time_scale, args.slo_ttft, args.slo_tpot)
        ok = [r for r in model if r.ok]
        row = {"target": target.name, "workload": wl["name"], "concurrency": wl["concurrency"],
               "qpm": wl.get("qpm"),
               "summary": summary, "ttfts": [r.ttft for r in ok if r.ttft is not None],
               "errors": [r.error for r in model if not r.ok][:3],
               "slo_share": (sum(1 for r in ok if r.ttft is not None and r.ttft <= args.slo_ttft
                                 and (r.tpot is None or r.tpot <= args.slo_tpot))
                             / max(1, len(model))),
               # share of the run each prefill worker was computing (idle time costs throughput)
               "prefill_busy_share": [round(b / duration, 4) for b in busy],
               **steady_rates(model, args.slo_ttft, args.slo_tpot)}
        if target.router == "omni":
            time.sleep(1.2)  # the access log is flushed about every second
            row["prediction"] = prediction_match(access)
            row["cache_truth"] = target.cache_truth
            row["cache_prediction"] = state.get("cache_prediction")
            row["released"] = state.get("released")
            row["max_hold_s"] = state.get("max_hold_s")
        rows.append(row)
        s = summary
        print(f"  {target.name:26s} {wl['name']:10s} c={wl['concurrency']:<4} "
              f"QPM {s['requests_per_minute']:7.1f}  goodput {s['goodput_requests_per_minute']:7.1f}"
              f"  TTFT p50/p99 {s['median_ttft_ms'] or 0:7.0f}/{s['p99_ttft_ms'] or 0:7.0f} ms"
              f"  TPOT p50 {s['median_tpot_ms'] or 0:5.1f} ms  err {s['errors']}"
              f"  prefill busy {sum(row['prefill_busy_share']) / max(1, len(busy)):.0%}"
              f"  steady QPM {row['steady_qpm'] or 0:.0f} goodput {row['steady_goodput_qpm'] or 0:.0f}"
              + (f"  released {row['released']}" if row.get("released") else ""), flush=True)
    return rows


def paper_spec(num_requests: int, seed: int, output_scale: float) -> WorkloadSpec:
    """The paper mix as every run here draws it (headroom.py redraws a run's prompts with it)."""
    return WorkloadSpec(num_requests=num_requests, seed=seed, vocab_size=VOCAB,
                        output_scale=output_scale, max_total_len=8000)


def build_workloads(args: argparse.Namespace, concurrency: list[int],
                    open_qpm: float | None = None) -> list[dict[str, Any]]:
    spec = paper_spec(args.num_requests, args.seed, args.output_scale)
    reqs = paper(dataclasses.replace(spec, num_requests=args.num_requests
                                     + args.requests_per_client * max(concurrency)))
    # more clients need more requests, or the run is one burst and its drain
    out = [{"name": "paper", "mode": "closed", "concurrency": c,
            "requests": reqs[:args.num_requests + args.requests_per_client * c]}
           for c in concurrency]
    mspec = WorkloadSpec(num_requests=args.mooncake_requests, seed=args.seed, vocab_size=VOCAB,
                         input_scale=args.mooncake_input_scale, output_scale=args.output_scale,
                         max_total_len=8000)
    if open_qpm:  # the same mix at a fixed Poisson rate: tail latency at equal QPM
        rng = np.random.default_rng(args.seed + 1)
        gaps = rng.exponential(60.0 / open_qpm, size=args.open_requests)
        fresh = paper(dataclasses.replace(spec, num_requests=args.open_requests,
                                          seed=args.seed + 1))
        out.append({"name": "paper-open", "mode": "open", "concurrency": 0, "qpm": open_qpm,
                    "requests": [dataclasses.replace(r, arrival_s=float(t))
                                 for r, t in zip(fresh, np.cumsum(gaps), strict=True)]})
    out.append({"name": "mooncake", "mode": "open", "concurrency": 0, "speedup": args.trace_speedup,
                "requests": mooncake(mspec)})
    return out


def _shown(path: Path) -> str:
    """A path as results record it: relative to the repository when inside it."""
    try:
        return str(path.resolve().relative_to(HERE.parents[1]))
    except ValueError:
        return str(path)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # so the finally blocks stop every process group we started


def main() -> int:
    signal.signal(signal.SIGTERM, _interrupt)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer requests and points (minutes)")
    p.add_argument("--profile", default="h100-llama3-8b")
    p.add_argument("--time-scale", type=float, default=2.0,
                   help="wall seconds per model second of the emulators (2: half speed, so the "
                   "load generator and routers keep up on a small shared machine)")
    p.add_argument("--clusters", default="2P1D,4P1D")
    p.add_argument("--concurrency", default=None, help="4P1D sweep, comma list (paper workload)")
    p.add_argument("--small-concurrency", default=None, help="the other clusters' sweep")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--repeats", type=int, default=1,
                   help="run every (target, workload) this many times, interleaved; the report "
                   "gives medians, spreads and per-repeat paired ratios")
    p.add_argument("--requests-per-client", type=int, default=4,
                   help="paper workload: requests = --num-requests + this × concurrency (with "
                   "2 the first burst and the drain were most of a run, and runs varied 2×)")
    p.add_argument("--output-scale", type=float, default=0.05,
                   help="output lengths × this (keeps the stream volume within 2 CPU cores)")
    p.add_argument("--open-qpm", type=float, default=1800.0,
                   help="paper workload open loop (Poisson) at this many requests per model "
                   "minute on 4P1D (scaled by the prefill count elsewhere), for P99 TTFT at equal "
                   "QPM; about 80%% of what 4P1D of h100-llama3-8b serves closed-loop; 0: skip")
    p.add_argument("--open-requests", type=int, default=300)
    p.add_argument("--mooncake-requests", type=int, default=None)
    p.add_argument("--mooncake-input-scale", type=float, default=0.25)
    p.add_argument("--trace-speedup", type=float, default=14.0,
                   help="replay the Mooncake trace this many times faster than recorded (14: "
                   "close to 4P1D's capacity; at 8 every policy met the SLO for every request, "
                   "so there was no ranking to compare)")
    p.add_argument("--slo-ttft", type=float, default=2.0)
    p.add_argument("--slo-tpot", type=float, default=0.050)
    p.add_argument("--no-router-slo", action="store_true",
                   help="do not tell OmniProxy the TTFT objective (--oas-ttft-slo-secs); by "
                   "default it gets the same SLO the goodput is measured against")
    p.add_argument("--seed", type=int, default=0)
    add_peer_args(p)
    p.add_argument("--only", default=None, help="comma list of target names to run (the peer's: "
                   "smg:POLICY or sglang:POLICY, as --peer)")
    p.add_argument("--no-ablations", action="store_true")
    p.add_argument("--cache-truth", choices=("router", "kv-events", "both"), default="router",
                   help="what fills OmniProxy's prefix index: its own routing (router), the "
                   "emulators' KV events (kv-events), or run our policies in both modes")
    p.add_argument("--load-feed", choices=("off", "on", "both"), default="off",
                   help="the emulators publish SGLang's load feed (--load-publish-endpoint), "
                   "which OmniProxy then reads instead of polling (on); both: our policies also "
                   "run polling beside it (omni:POLICY+poll). The peer polls either way")
    p.add_argument("--ablation-concurrency", type=int, default=None,
                   help="paper concurrency of the ablation runs (default: the sweep's third)")
    p.add_argument("--ablations-everywhere", action="store_true",
                   help="run the ablations at every paper concurrency, not only at one")
    p.add_argument("--log-dir", type=Path, default=None,
                   help="router and emulator logs (default: OUTPUT_DIR/logs)")
    p.add_argument("--output-dir", type=Path,
                   default=HERE.parent / "results" / "proxy")
    p.add_argument("--docs", type=Path, default=None,
                   help="append/replace the 'OmniProxy OAS evaluation' section of this file")
    args = p.parse_args()
    quick = args.quick
    args.concurrency = [int(c) for c in (args.concurrency or ("64,128" if quick else
                                                              "64,96,128")).split(",")]
    args.small_concurrency = [int(c) for c in (args.small_concurrency or "48").split(",")]
    args.ablation_concurrency = args.ablation_concurrency or args.concurrency[
        min(1, len(args.concurrency) - 1)]
    args.num_requests = args.num_requests or (30 if quick else 40)
    if quick:
        args.requests_per_client = 1
        args.open_requests = min(args.open_requests, 200)
    args.mooncake_requests = args.mooncake_requests or (60 if quick else 160)
    out_dir: Path = args.output_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    log_dir = args.log_dir or out_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    truths = ("router", "kv-events") if args.cache_truth == "both" else (args.cache_truth,)
    rows: list[dict[str, Any]] = []
    t0 = time.monotonic()
    for name in args.clusters.split(","):
        n_p, n_d = int(name.split("P")[0]), int(name.split("P")[1].rstrip("D"))
        print(f"cluster {name}: {n_p} prefill + {n_d} decode '{args.profile}' emulators, "
              f"time scale {args.time_scale}", flush=True)
        sweep = args.concurrency if name == "4P1D" else args.small_concurrency
        workloads = build_workloads(args, sweep, args.open_qpm * n_p / 4 if args.open_qpm else None)
        cluster = EmulatedCluster(n_p, n_d, args.profile, args.time_scale, log_dir / name,
                                  kv_events=args.cache_truth != "router",
                                  load_feed=args.load_feed != "off")
        try:  # targets interleaved per workload, so a change in the box's load hits them all
            for repeat, wl in ((rep, wl) for rep in range(args.repeats) for wl in workloads):
                for target in targets(name == "4P1D" and not args.no_ablations, truths,
                                      args.peer, polled=args.load_feed == "both"):
                    if args.only and target.name not in args.only.split(","):
                        continue
                    if (target.policy in ABLATIONS and not args.ablations_everywhere
                            and wl["concurrency"] not in (0, args.ablation_concurrency)):
                        continue
                    try:
                        done = run_target(target, cluster, [wl], args, log_dir)
                    except RuntimeError as exc:  # one broken run must not end the others
                        print(f"  {target.name}: FAILED: {str(exc)[:300]}", flush=True)
                        done = [{"target": target.name, "workload": wl["name"],
                                 "concurrency": wl["concurrency"], "failed": str(exc)[:2000]}]
                    for row in done:
                        row["cluster"] = name
                        row["repeat"] = repeat
                        rows.append(row)
                (out_dir / "results.partial.json").write_text(json.dumps(rows))
        finally:
            cluster.stop()
    meta = {key: (_shown(v) if isinstance(v, Path) else v) for key, v in vars(args).items()}
    meta["wall_s"] = time.monotonic() - t0
    reqs = build_workloads(args, args.concurrency)
    meta["paper_mean_input"] = float(np.mean([r.prompt_tokens for r in reqs[-2]["requests"]]))
    meta["paper_mean_output"] = float(np.mean([r.output_tokens for r in reqs[-2]["requests"]]))
    meta["mooncake_mean_input"] = float(np.mean([r.prompt_tokens for r in reqs[-1]["requests"]]))
    (out_dir / "results.json").write_text(json.dumps({"meta": meta, "runs": rows}, indent=1))
    text = write_report(rows, meta, out_dir, args.docs)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
