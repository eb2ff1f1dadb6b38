"""OmniProxy against the Rust router (smg) where the prefix cache decides: an open-loop rate sweep.

Emulated ``h100-llama3-8b`` clusters — 8 regular workers (``8R``) and 4 prefill + 1 decode
(``4P1D``) — whose caching workers (regular, prefill) get a KV pool of ``--cache-tokens`` so
that the workload's shared prefixes do not all fit and eviction happens, each publishing SGLang's
KV events. Workloads (``omniinfer bench``'s builders, prompts cut from real text with the
SmolLM2 tokenizer): ``prefix-groups`` (llm-d's shape: groups x shared prefix x users x fresh
query) and ``multi-turn`` (each turn extends the previous prompt and answer). At each rate
(model requests per second per caching worker; Poisson arrivals, the same for every router)
every target runs in turn, each on flushed caches with a fresh router: OmniProxy ``oas`` with
its own prefix index, ``oas`` with KV-event cache truth, our ``cache_aware``, and the peer
(``--peer``): smg 1.13 (PyPI) with each of its policies that apply (``smg:round_robin``,
``smg:power_of_two``, ``smg:cache_aware``, ``smg:least_load``, ``smg:prefix_hash``,
``smg:consistent_hashing``, and ``smg:bucket`` on PD clusters only), or ``--peer sglang-router``:
``sglang_router`` 0.3.2 with ``sglang:round_robin``, ``sglang:cache_aware`` and
``sglang:power_of_two``. Beside smg both routers poll worker loads every ``--poll-secs`` (smg's
--load-monitor-interval, OmniProxy's --loads-poll-interval-secs); beside sglang-router OmniProxy
polls every 0.5 s. Times are converted to model seconds; the first ``--warmup-share`` of
requests warms the caches and is not measured. Goodput = measured requests within the SLO
(TTFT and TPOT) per model minute of their send window. ``--repeats`` repeats the sweep (targets
rotated); the report gives medians, spreads and per-repeat paired ratios, a PNG per cluster,
``results.json`` and ``tables.md``.

    python benchmark/proxy/prefix_eval.py --quick                  # smoke run, smg as the peer
    python benchmark/proxy/prefix_eval.py --rates 4,6,9 --repeats 2 # a sized full run
    python benchmark/proxy/prefix_eval.py --peer sglang-router       # the older peer
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import signal
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
from cluster import (
    PEER_PREFIX,
    PREFILL_ONLY,
    EmulatedCluster,
    add_peer_args,
    free_port,
    peer_of,
    peer_targets,
    start_router,
    target_router_command,
)
from oas_eval import router_state, to_model_time
from prefix_report import write_report
from tqdm import tqdm

from omniinfer.bench.client import RequestResult
from omniinfer.bench.prefix_workloads import PREFIX_WORKLOADS
from omniinfer.bench.runner import run_trace_replay
from omniinfer.bench.workloads import BenchRequest, WorkloadSpec, poisson_arrivals

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

CLUSTERS = {"8R": (0, 0, 8), "4P1D": (4, 1, 0)}  # (prefill, decode, regular)
OMNI_TARGETS = ("omni:oas", "omni:oas@kv-events", "omni:cache_aware")
TOKENIZER = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"
RUN_OVERHEAD_S = 16.0  # flush, router start and stop, drain past saturation (the --quick run here)


@dataclasses.dataclass(frozen=True)
class Target:
    name: str  # "omni:oas@kv-events", "smg:cache_aware"
    router: str  # "omni" | "smg" | "sglang" (sglang-router)
    policy: str
    truth: str = "router"  # what fills OmniProxy's prefix index

    @classmethod
    def parse(cls, name: str) -> Target:
        router, _, rest = name.partition(":")
        policy, _, truth = rest.partition("@")
        if (router != "omni" and peer_of(router) is None) or not policy or (
                truth and router != "omni"):
            raise ValueError(f"bad target {name!r}: omni:POLICY[@kv-events], smg:POLICY or "
                             "sglang:POLICY")
        return cls(name, router, policy, truth or "router")


def default_targets(peer: str) -> list[str]:
    """Ours, then every policy of the peer (bucket is skipped on regular clusters)."""
    return [*OMNI_TARGETS, *peer_targets(peer, pd=True)]


def cluster_targets(targets: list[Target], cluster: str) -> list[Target]:
    """The targets that apply to ``cluster``: a prefill-only policy (bucket) needs PD."""
    pd = CLUSTERS[cluster][2] == 0
    return [t for t in targets if pd or getattr(t, "policy", None) not in PREFILL_ONLY]


def caching_workers(cluster: str) -> int:
    n_prefill, _, n_regular = CLUSTERS[cluster]
    return n_prefill + n_regular


def requests_per_run(args: argparse.Namespace, rate: float) -> int:
    """Enough requests for ``--run-seconds`` of arrivals at ``rate`` (the whole cluster): every
    rate runs as long in model time, so queues have as long to build up past saturation."""
    return max(16, round(rate * args.run_seconds))


def build_requests(args: argparse.Namespace, workload: str, rate: float, tokenizer: Any,
                   seed: int) -> list[BenchRequest]:
    """The workload with Poisson arrivals at ``rate`` model requests/s (the whole cluster)."""
    n = requests_per_run(args, rate)
    spec = WorkloadSpec(
        num_requests=n, output_len=args.output_len, seed=args.seed,
        prefix_len=args.prefix_len, num_groups=args.groups, users_per_group=args.users_per_group,
        query_len=args.query_len, conversations=math.ceil(n / args.turns),
        turns=args.turns, turn_len=args.turn_len, think_s=args.think_time,
        max_total_len=8000, vocab_size=49152)
    return poisson_arrivals(PREFIX_WORKLOADS[workload](spec, tokenizer), rate, seed)


def measure(results: list[RequestResult], args: argparse.Namespace) -> dict[str, Any]:
    """Model-time figures of the requests after the warm-up share (by send time)."""
    ordered = sorted(results, key=lambda r: r.start)
    measured = ordered[int(len(ordered) * args.warmup_share):]
    ok = [r for r in measured if r.ok and r.ttft is not None]

    def good(r: RequestResult) -> bool:
        return r.ttft is not None and r.ttft <= args.slo_ttft and (
            r.tpot is None or r.tpot <= args.slo_tpot)

    window = max((measured[-1].start - measured[0].start) if measured else 0.0, 1e-9) / 60.0
    ttfts = np.array([r.ttft for r in ok], dtype=float)
    tpots = [r.tpot for r in ok if r.tpot is not None]
    reported = [r for r in ok if r.cached_tokens is not None]

    def pct(p: float) -> float | None:
        return float(np.percentile(ttfts, p)) if ttfts.size else None

    return {"measured": len(measured), "errors": sum(1 for r in measured if not r.ok),
            "error_samples": [r.error for r in measured if not r.ok][:3],
            "good": sum(1 for r in ok if good(r)), "goodput_qpm": sum(map(good, ok)) / window,
            "qpm": len(ok) / window, "slo_share": sum(map(good, ok)) / max(1, len(measured)),
            "p50_ttft_s": pct(50), "p90_ttft_s": pct(90), "p99_ttft_s": pct(99),
            "p50_tpot_ms": 1e3 * statistics.median(tpots) if tpots else None,
            "cached_share": (sum(r.cached_tokens or 0 for r in reported)
                             / max(1, sum(r.prompt_tokens for r in reported))
                             if reported else None)}


def router_command(target: Target, cluster: EmulatedCluster, port: int,
                   args: argparse.Namespace) -> list[str]:
    """The target's router beside ``args.peer``; OAS's objective is --slo-ttft in wall seconds."""
    return target_router_command(target.router, target.policy, cluster, port, peer=args.peer,
                                 poll_secs=args.poll_secs, cache_truth=target.truth,
                                 ttft_slo_secs=args.slo_ttft * args.time_scale)


def run_one(target: Target, cluster: EmulatedCluster, requests: list[BenchRequest],
            args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    """Flushed caches, a fresh router, the open-loop run; the measured figures."""
    cluster.flush()
    port = free_port()
    log = log_dir / f"{target.name.replace(':', '_').replace('@', '_')}.log"
    router = start_router(router_command(target, cluster, port, args), port, log)
    state: dict[str, Any] = {}
    try:
        results, _ = asyncio.run(run_trace_replay(
            f"http://127.0.0.1:{port}", requests, args.time_scale, progress=False,
            timeout_s=600))
        if target.router == "omni":
            state = router_state(port)
    finally:
        router.stop()
    row = measure(to_model_time(results, args.time_scale), args)
    row["cache_prediction"] = state.get("cache_prediction")
    row["released"] = state.get("released")  # oas: why each request left the proxy
    return row


def plan(args: argparse.Namespace) -> list[tuple[str, str, float]]:
    """(cluster, workload, rate per caching worker) points, in run order; a quick run sweeps
    only its first workload and runs the others at the highest rate."""
    return [(c, w, r) for c in args.clusters for i, w in enumerate(args.workloads)
            for r in (args.rates if not args.quick or i == 0 else args.rates[-1:])]


def estimate_s(args: argparse.Namespace) -> float:
    """Wall seconds the sweep should take: each run's arrivals, a chat's chain of turns (a
    turn, then the think time) or a drain of about one model second, and the overheads."""
    total = 0.0
    for cluster, workload, _ in plan(args):
        tail = args.turns * (args.think_time + 0.5) if workload == "multi-turn" else 1.0
        total += len(cluster_targets(args.targets, cluster)) * (
            (args.run_seconds + tail) * args.time_scale + RUN_OVERHEAD_S)
    return total * args.repeats


def _shown(path: Path) -> str:
    """A path as results record it: relative to the repository when inside it."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # so the finally blocks stop every process group we started


def _load_tokenizer(path: str) -> Any:
    if path == "none":
        return None
    if not Path(path).exists():
        raise SystemExit(f"prefix_eval: tokenizer {path} not found; pass --tokenizer PATH "
                         "or --tokenizer none (random token ids)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 1.5 model seconds per run, 1 repeat, the first workload at "
                   "2 rates and the others at the higher one")
    p.add_argument("--clusters", default="8R,4P1D", help=f"comma list of {', '.join(CLUSTERS)}")
    p.add_argument("--workloads", default="prefix-groups,multi-turn",
                   help=f"comma list of {', '.join(PREFIX_WORKLOADS)}")
    p.add_argument("--rates", default="4.5,6.75,10.125,15.1875,22.78125",
                   help="model requests/s per caching worker (regular or prefill), comma list; "
                   "1.5x steps let the report judge the knee and 1.5x the knee")
    p.add_argument("--repeats", type=int, default=1, help="repeat the sweep (targets rotated)")
    p.add_argument("--targets", default=None,
                   help="comma list of router:policy (default: ours and every policy of the "
                   "peer; smg:POLICY or sglang:POLICY as --peer)")
    add_peer_args(p)
    p.add_argument("--run-seconds", type=float, default=4.0,
                   help="model seconds of arrivals per run (requests = rate x this)")
    p.add_argument("--warmup-share", type=float, default=0.25,
                   help="first share of requests (by send time) warms the caches, unmeasured")
    p.add_argument("--time-scale", type=float, default=8.0,
                   help="wall seconds per model second of the emulators (slack for a busy box)")
    p.add_argument("--cache-tokens", type=int, default=40960,
                   help="KV pool of each caching worker (the profile has 395,000): below the "
                   "workload's distinct prefixes, so a router that spreads a group evicts")
    p.add_argument("--groups", type=int, default=16,
                   help="prefix-groups (llm-d: 150 groups of a 6K prefix, 5 users, 1.2K queries)")
    p.add_argument("--prefix-len", type=int, default=6144)
    p.add_argument("--users-per-group", type=int, default=5)
    p.add_argument("--query-len", type=int, default=1200)
    p.add_argument("--turns", type=int, default=4, help="multi-turn: turns per chat")
    p.add_argument("--turn-len", type=int, default=768, help="multi-turn: new tokens per turn")
    p.add_argument("--think-time", type=float, default=0.25, help="multi-turn: model seconds")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--slo-ttft", type=float, default=1.0, help="model seconds")
    p.add_argument("--slo-tpot", type=float, default=0.050, help="model seconds")
    p.add_argument("--tokenizer", default=str(TOKENIZER), help="prompt text's tokenizer, or none")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", type=Path, default=HERE.parent / "results" / "proxy" / "prefix")
    p.add_argument("--log-dir", type=Path, default=None, help="default: OUTPUT_DIR/logs")
    p.add_argument("--docs", type=Path, default=None,
                   help="replace the generated block of the prefix section in this file")
    args = p.parse_args()
    if args.quick:
        args.rates = "10.125,15.1875" if args.rates == p.get_default("rates") else args.rates
        args.run_seconds = 1.5 if args.run_seconds == p.get_default("run_seconds") else (
            args.run_seconds)
        args.repeats = 1
    args.clusters = args.clusters.split(",")
    args.workloads = args.workloads.split(",")
    args.rates = [float(r) for r in args.rates.split(",")]
    try:
        args.targets = [Target.parse(t) for t in (
            args.targets or ",".join(default_targets(args.peer))).split(",")]
    except ValueError as exc:
        p.error(str(exc))
    other = [t.name for t in args.targets if t.router not in ("omni", PEER_PREFIX[args.peer])]
    if other:  # the load-polling rate is matched to one peer
        p.error(f"targets {', '.join(other)} are not of --peer {args.peer}")
    unknown = ([c for c in args.clusters if c not in CLUSTERS]
               + [w for w in args.workloads if w not in PREFIX_WORKLOADS])
    if unknown or not all(r > 0 for r in args.rates) or not 0 <= args.warmup_share < 1:
        p.error(f"bad --clusters/--workloads/--rates/--warmup-share ({', '.join(unknown)})")
    return args


def main() -> int:
    signal.signal(signal.SIGTERM, _interrupt)
    args = parse_args()
    tokenizer = _load_tokenizer(args.tokenizer)
    out_dir: Path = args.output_dir
    log_root = args.log_dir or out_dir / "logs"
    out_dir.mkdir(parents=True, exist_ok=True)
    points = plan(args)
    runs = sum(len(cluster_targets(args.targets, c)) for c, _, _ in points) * args.repeats
    print(f"{len(points)} points x {len(args.targets)} targets x {args.repeats} repeats "
          f"({runs} runs, peer {args.peer}); estimated {estimate_s(args) / 60:.0f} min",
          flush=True)
    rows: list[dict[str, Any]] = []
    t0 = time.monotonic()
    bar = tqdm(total=runs, unit="run")
    for name in args.clusters:
        n_prefill, n_decode, n_regular = CLUSTERS[name]
        cluster = EmulatedCluster(n_prefill, n_decode, "h100-llama3-8b", args.time_scale,
                                  log_root / name, kv_events=True, n_regular=n_regular,
                                  cache_extra=("--max-total-tokens", str(args.cache_tokens)))
        try:
            for repeat in range(args.repeats):
                for k, (_, workload, rate) in enumerate(p for p in points if p[0] == name):
                    total_rate = rate * caching_workers(name)
                    requests = build_requests(args, workload, total_rate, tokenizer,
                                              args.seed + 1000 * repeat + k)
                    here = cluster_targets(args.targets, name)
                    shift = repeat % max(1, len(here))  # no target always runs first
                    for target in here[shift:] + here[:shift]:
                        bar.set_description(f"{name} {workload} {rate:g} {target.name}")
                        key = {"cluster": name, "workload": workload, "rate": rate,
                               "target": target.name, "repeat": repeat}
                        try:
                            row = {**key, **run_one(target, cluster, requests, args,
                                                    log_root / name)}
                        except RuntimeError as exc:  # one broken run must not end the others
                            row = {**key, "failed": str(exc)[:2000]}
                        rows.append(row)
                        bar.update(1)
                        (out_dir / "results.partial.json").write_text(json.dumps(rows))
        finally:
            cluster.stop()
    bar.close()
    meta = {**vars(args), "targets": [t.name for t in args.targets],
            "tokenizer": Path(args.tokenizer).name, "output_dir": _shown(args.output_dir),
            "log_dir": _shown(log_root), "docs": _shown(args.docs) if args.docs else None}
    meta["wall_s"] = time.monotonic() - t0
    (out_dir / "results.json").write_text(json.dumps({"meta": meta, "runs": rows}, indent=1))
    print(write_report(rows, out_dir, args.docs))
    print(f"wall {meta['wall_s'] / 60:.1f} min; wrote {out_dir}/results.json, tables.md, "
          "prefix_*.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
