"""SLO capacity of OmniProxy's OAS and of smg 1.13's policies, open loop, on emulated PD clusters.

A router's SLO capacity is the highest offered request rate at which a share of its requests
(90 %, and 99 %) finish within the SLO (TTFT < 2 s, TPOT < 50 ms, in model time), found by
sweeping the open-loop rate and interpolating linearly between the two points that bracket the
share. Workloads: ``paper`` (the paper's mix, Poisson arrivals at each rate), ``azure`` (the
Azure LLM inference conversation trace, 2023) and ``mooncake`` (Mooncake's conversation trace,
inputs × 0.25, its hash blocks shared prefixes, sent as text with one word per token id so
that text-matching prefix trees see the sharing): both traces keep their own arrival times,
replayed faster. Outputs are × 0.05 everywhere (two CPU cores cannot stream 1K-token outputs at
these rates). Clusters: ``4P1D``, ``8P2D`` and ``4P1D-slow`` (one prefill worker 1.5× slower in
every prefill cost term). Emulated ``h100-llama3-8b`` workers at ``--time-scale``. The peer is
smg 1.13 (``smg:POLICY`` targets) or, with ``--peer sglang-router``, the old Rust router
(``sglang:POLICY``); with ``--kv-events`` the workers publish SGLang's KV events and each of our
policies also runs as ``omni:POLICY@kv-events``. The verdict lines compare with smg only.

Every (rate, repeat) point runs every target interleaved with flushed caches and a fresh router;
a target stops climbing once it has fallen below 90 % twice or below 75 % once (the knee is
behind it). Repeats draw other prompts and arrival times (paper: seed + repeat) or another window
of the trace (``--trace-offset`` + repeat × requests). The report gives per target the median
capacity over the repeats and its range, OAS's ratio to the best smg policy (per repeat and the
median), and the P99 TTFT of both at the best smg policy's capacity rate. Writes
``results.json`` (every run), ``capacity.json`` (the summary), ``tables.md`` and
``capacity.png`` (share within the SLO against offered rate) to ``--output-dir``.

    python benchmark/proxy/capacity.py --quick                  # a few minutes
    python benchmark/proxy/capacity.py --workloads paper,azure --clusters 4P1D --repeats 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
from capacity_math import capacity_at, markdown, summarize_capacity
from cluster import EmulatedCluster, add_peer_args, peer_targets
from oas_eval import Target, run_target

from omniinfer.bench.workloads import (
    BenchRequest,
    WorkloadSpec,
    as_word_text,
    azure,
    mooncake,
    paper,
)
from omniinfer.emulator.profile import dump_profile, load_profile

HERE = Path(__file__).resolve().parent

VOCAB = 128000
CLUSTERS = {"4P1D": (4, 1, 0), "8P2D": (8, 2, 0), "4P1D-slow": (4, 1, 1)}  # (P, D, slow ones)
SLOW_FACTOR = 1.5
DEFAULT_MULTIPLIERS = "0.95,1.05,1.15,1.25,1.35,1.5"


def slow_profile(base: str, factor: float, folder: Path) -> str:
    """A profile file whose prefill cost terms are ``factor`` × ``base``'s (a slower worker)."""
    profile = load_profile(base)
    cost = profile.cost
    slow = profile.with_cost(**{name: getattr(cost, name) * factor for name in (
        "prefill_base_s", "prefill_per_request_s", "prefill_per_token_s", "prefill_attention_s")})
    path = folder / f"{base}-slow{factor:g}.yaml"
    path.write_text(dump_profile(dataclasses.replace(slow, name=f"{base}-slow{factor:g}")))
    return str(path)


def prefill_seconds(profile: str, prompts: list[int]) -> float:
    """Mean predicted prefill seconds of one prompt on one worker of ``profile`` (no cache)."""
    cost = load_profile(profile).cost
    return float(np.mean([cost.prefill_per_request_s + cost.prefill_per_token_s * n
                          + cost.prefill_attention_s * n * n / 2 for n in prompts]))


def base_requests(workload: str, n: int, seed: int, offset: int, output_scale: float
                  ) -> list[BenchRequest]:
    """``n`` requests of the workload (arrival times in model seconds from 0; paper: none)."""
    if workload == "paper":
        return paper(WorkloadSpec(num_requests=n, seed=seed, vocab_size=VOCAB,
                                  output_scale=output_scale, max_total_len=8000))
    if workload == "azure":
        rows = azure(WorkloadSpec(num_requests=offset + n, seed=seed, vocab_size=VOCAB,
                                  output_scale=output_scale, max_total_len=8000))
    elif workload == "mooncake":  # sent as text: smg's cache_aware matches text, not ids
        rows = as_word_text(mooncake(WorkloadSpec(
            num_requests=offset + n, seed=seed, vocab_size=VOCAB, input_scale=0.25,
            output_scale=output_scale, max_total_len=8000)))
    else:
        raise ValueError(f"unknown workload {workload!r}")
    rows = rows[offset:offset + n]
    if len(rows) < n:
        raise ValueError(f"{workload}: the trace has fewer than {offset + n} requests")
    first = rows[0].arrival_s
    return [dataclasses.replace(r, index=i, arrival_s=r.arrival_s - first)
            for i, r in enumerate(rows)]


def at_rate(requests: list[BenchRequest], workload: str, qpm: float, seed: int
            ) -> list[BenchRequest]:
    """The requests arriving at ``qpm`` per model minute: Poisson for the paper mix, the trace's
    own arrival times compressed for a trace (its mean rate becomes ``qpm``)."""
    if workload == "paper":
        gaps = np.random.default_rng(seed).exponential(60.0 / qpm, size=len(requests))
        times = np.cumsum(gaps)
    else:
        span = max(r.arrival_s for r in requests) or 1.0
        native = 60.0 * (len(requests) - 1) / span
        times = np.array([r.arrival_s for r in requests]) * native / qpm
    return [dataclasses.replace(r, arrival_s=float(t)) for r, t in zip(requests, times, strict=True)]


def target_list(only: str | None, ours: str = "oas", peer: str = "smg",
                kv_events: bool = False) -> list[Target]:
    """Our policies (each also as ``omni:POLICY@kv-events``, its prefix index filled from the
    workers' KV events, with ``kv_events``), then every policy of ``peer``; ``only`` keeps the
    names it lists."""
    out = [Target(f"omni:{p}", "omni", p) for p in ours.split(",")]
    if kv_events:
        out += [Target(f"omni:{p}@kv-events", "omni", p, cache_truth="kv-events")
                for p in ours.split(",")]
    out += [Target(name, *name.split(":", 1)) for name in peer_targets(peer, pd=True)]
    if only:
        keep = only.split(",")
        out = [t for t in out if t.name in keep]
    return out


def run_point(target: Target, cluster: EmulatedCluster, requests: list[BenchRequest],
              name: str, qpm: float, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    wl = {"name": name, "mode": "open", "concurrency": 0, "qpm": qpm, "requests": requests}
    try:
        row = run_target(target, cluster, [wl], args, log_dir)[0]
    except RuntimeError as exc:  # one broken run must not end the others
        print(f"  {target.name}: FAILED: {str(exc)[:300]}", flush=True)
        return {"target": target.name, "qpm": qpm, "failed": str(exc)[:2000], "slo_share": 0.0}
    row.pop("ttfts", None)
    return row


def sweep(cluster_name: str, workload: str, args: argparse.Namespace, out_rows: list[dict],
          log_dir: Path, save: Path) -> None:
    n_p, n_d, n_slow = CLUSTERS[cluster_name]
    args.time_scale = args.time_scales.get(workload, args.base_time_scale)
    slow = tuple(slow_profile(args.profile, SLOW_FACTOR, log_dir) for _ in range(n_slow))
    cluster = EmulatedCluster(n_p, n_d, args.profile, args.time_scale,
                              log_dir / cluster_name, prefill_profiles=slow,
                              kv_events=args.kv_events)
    try:
        for repeat in range(args.repeats):
            reqs = base_requests(workload, args.requests, args.seed + repeat,
                                 args.trace_offset + repeat * args.requests, args.output_scale)
            per_req = prefill_seconds(args.profile, [r.prompt_tokens for r in reqs])
            workers = (n_p - n_slow) + n_slow / SLOW_FACTOR
            knee = 60.0 * workers / per_req  # QPM the prefill fleet serves without a cache
            done: dict[str, list[float]] = {}
            for mult in args.multipliers:
                qpm = round(knee * mult * args.knee_scale.get(workload, 1.0), 1)
                arrivals = at_rate(reqs, workload, qpm, args.seed + 1000 * repeat + 1)
                for target in target_list(args.only, args.ours, args.peer, args.kv_events):
                    shares = done.setdefault(target.name, [])
                    if sum(s < 0.9 for s in shares) >= 2 or any(s < 0.75 for s in shares):
                        continue
                    row = run_point(target, cluster, arrivals, workload, qpm, args, log_dir)
                    row.update(cluster=cluster_name, workload=workload, repeat=repeat,
                               multiplier=mult, qpm=qpm, knee_estimate_qpm=knee)
                    shares.append(row["slo_share"])
                    out_rows.append(row)
                    save.write_text(json.dumps(out_rows))
    finally:
        cluster.stop()


def plot(summary: dict[str, Any], rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["cluster"], r["workload"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (cluster, workload) in zip(axes[0], panels, strict=True):
        mine = [r for r in rows if (r["cluster"], r["workload"]) == (cluster, workload)]
        for name in sorted({r["target"] for r in mine}):
            for repeat in sorted({r["repeat"] for r in mine}):
                pts = sorted((r["qpm"], r["slo_share"]) for r in mine
                             if r["target"] == name and r["repeat"] == repeat)
                style = dict(lw=2.2 if name.startswith("omni") else 1.0,
                             color=None if not name.startswith("omni") else "black")
                ax.plot(*zip(*pts, strict=True), marker="o", ms=3, alpha=0.85,
                        label=name if repeat == 0 else None, **style)
        ax.axhline(0.9, color="grey", ls="--", lw=0.8)
        ax.set_title(f"{workload} on {cluster}")
        ax.set_xlabel("offered rate (requests per model minute)")
        ax.set_ylabel("share within TTFT < 2 s, TPOT < 50 ms")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_summary(summary: dict[str, Any]) -> None:
    for key, panel in summary.items():
        print(f"\n== {key} ==")
        for name, cap in sorted(panel["targets"].items(), key=lambda kv: -(kv[1]["cap90"] or 0)):
            print(f"  {name:24s} cap90 {cap['cap90_text']:>22s}  cap99 {cap['cap99_text']:>22s}"
                  f"  errors {cap['errors']}")
        for line in panel["verdict"]:
            print("  " + line)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> int:
    signal.signal(signal.SIGTERM, _interrupt)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="200 requests, 4 rates, oas and 2 peers")
    p.add_argument("--workloads", default="paper,azure")
    p.add_argument("--clusters", default="4P1D")
    p.add_argument("--requests", type=int, default=600, help="requests per point (>= 600 passes "
                   "the knee at every rate measured)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--multipliers", default=DEFAULT_MULTIPLIERS,
                   help="offered rates as multiples of the fleet's estimated prefill capacity")
    p.add_argument("--knee-scale", default="mooncake=1.6,azure=1.5",
                   help="per workload, a factor on the estimate (mooncake: its cache hits; azure: its "
                   "lulls, measured: 1.3x the estimate kept every router at >= 97 %%)")
    p.add_argument("--trace-offset", type=int, default=0, help="first trace request used")
    p.add_argument("--profile", default="h100-llama3-8b")
    p.add_argument("--time-scale", type=float, default=2.0,
                   help="wall seconds per model second of the emulators")
    p.add_argument("--time-scales", default="azure=4",
                   help="per workload, another time scale (azure: its rates are 3-5x the "
                   "paper mix's in requests, which two cores stream only at half that speed)")
    p.add_argument("--output-scale", type=float, default=0.05)
    p.add_argument("--slo-ttft", type=float, default=2.0)
    p.add_argument("--slo-tpot", type=float, default=0.050)
    p.add_argument("--no-router-slo", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ours", default="oas", help="OmniProxy policies run (comma list); the "
                   "verdict compares omni:oas")
    p.add_argument("--only", default=None, help="comma list of targets (omni:oas, "
                   "omni:oas@kv-events, smg:POLICY, sglang:POLICY)")
    p.add_argument("--kv-events", action="store_true", help="the workers publish SGLang's KV "
                   "events, and each of our policies also runs as POLICY@kv-events")
    add_peer_args(p)
    p.add_argument("--output-dir", type=Path, default=HERE.parent / "results" / "proxy" / "capacity")
    p.add_argument("--report", type=Path, default=None, metavar="RESULTS_JSON",
                   help="no runs: rebuild capacity.json, tables.md and capacity.png beside "
                   "this results.json")
    args = p.parse_args()
    if args.report is not None:
        return report(args.report)
    if args.quick:
        args.requests, args.repeats = min(args.requests, 200), 1
        args.multipliers = "0.9,1.1,1.3,1.5"
        args.only = args.only or "omni:oas,smg:round_robin,smg:bucket"
    args.multipliers = [float(m) for m in args.multipliers.split(",")]
    args.base_time_scale = args.time_scale
    args.time_scales = {k: float(v) for k, v in (kv.split("=") for kv in args.time_scales.split(",")
                                                 if kv)}
    args.knee_scale = {k: float(v) for k, v in (kv.split("=") for kv in args.knee_scale.split(",")
                                                if kv)}
    out_dir: Path = args.output_dir
    log_dir = out_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    t0 = time.monotonic()
    for cluster_name in args.clusters.split(","):
        for workload in args.workloads.split(","):
            print(f"== {workload} on {cluster_name} ==", flush=True)
            sweep(cluster_name, workload, args, rows, log_dir, out_dir / "results.partial.json")
    meta = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    meta["wall_s"] = time.monotonic() - t0
    (out_dir / "results.json").write_text(json.dumps({"meta": meta, "runs": rows}, indent=1))
    return report(out_dir / "results.json")


def report(results: Path) -> int:
    """capacity.json, tables.md and capacity.png beside ``results`` (a results.json)."""
    data = json.loads(results.read_text())
    rows, meta = data["runs"], data.get("meta", {})
    summary = summarize_capacity(rows)
    out_dir = results.parent
    (out_dir / "capacity.json").write_text(json.dumps({"meta": meta, "summary": summary},
                                                      indent=1))
    (out_dir / "tables.md").write_text(markdown(summary))
    plot(summary, rows, out_dir / "capacity.png")
    print_summary(summary)
    return 0


__all__ = ["at_rate", "base_requests", "capacity_at", "main", "slow_profile"]

if __name__ == "__main__":
    raise SystemExit(main())
