"""Decode latency while expert weights migrate: OmniPlacement vs SGLang's synchronous EPLB update.

Three real 2-rank SGLang CPU servers (``--tp 2 --ep 2 --ep-num-redundant-experts 2``) on the
same random Qwen3-MoE (16 experts of 256x512 per layer, 4 layers: about 25 MB of expert
weights per layer), started one after another so they never share the cores:

- ``baseline``: no rebalancing at all (the peer both are measured against);
- ``sglang-eplb``: ``--enable-eplb --eplb-rebalance-num-iterations N`` (weights move inside
  the forward loop, synchronously);
- ``omni``: ``--enable-omni-placement --omni-placement-interval N`` with trigger 1.0 and margin
  0 so it migrates about as often (weights staged in the background, switched at a boundary).

The same skewed decode workload runs on each (concurrent streams of one repeated prompt, so the
router sends most tokens to a few experts): every inter-token latency (ITL) is recorded. The
script prints mean / p99 / max ITL per server, the slowdown against the baseline, and for omni
the ITL of tokens that arrived while a migration was being staged versus the others. Results:
results/migration_stall.json and .png.

    .venv/bin/python benchmark/placement/migration_stall.py [--interval 10] [--tokens 160]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from omniinfer.child_process import free_port
from omniinfer.cpu.server_env import cpu_env
from omniinfer.testbed.models import tiny
from omniinfer.testbed.servers import SGLangServer, cpu_server_command

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = dict(hidden_size=256, moe_intermediate_size=512, num_experts=16, num_experts_per_tok=2,
             num_hidden_layers=4, head_dim=64)


async def stream(session: aiohttp.ClientSession, url: str, ids: list[int], tokens: int) -> list[float]:
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": tokens, "temperature": 0.0, "ignore_eos": True}}
    stamps: list[float] = []
    async with session.post(url + "/generate", json=body) as response:
        async for raw in response.content:
            if raw.startswith(b"data:") and b"[DONE]" not in raw:
                stamps.append(time.time())
    return stamps


async def workload(url: str, ids: list[int], streams: int, tokens: int) -> list[list[float]]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        return list(await asyncio.gather(*(stream(session, url, ids, tokens) for _ in range(streams))))


def run_server(name: str, model: Path, extra: list[str], args: argparse.Namespace, tmp: Path) -> dict:
    port = free_port()
    command = cpu_server_command(model, port, 8192, ["--tp", "2", "--ep", "2",
                                                     "--ep-num-redundant-experts", "2", *extra])
    log = tmp / f"{name}.log"
    with SGLangServer(command, cpu_env(threads_bind="0|1"), log, port, ready_timeout_s=600) as server:
        ids = list(range(40, 40 + args.prompt_len))
        asyncio.run(workload(server.base_url, ids, args.streams, 8))  # warm-up
        started = time.time()
        streams = asyncio.run(workload(server.base_url, ids, args.streams, args.tokens))
        status = None
        if name == "omni":
            with urllib.request.urlopen(server.base_url + "/omni/placement", timeout=30) as r:
                status = json.loads(r.read())
    itl, arrival = [], []
    for stamps in streams:
        itl.extend(np.diff(stamps).tolist())
        arrival.extend(stamps[1:])
    phase = phase_profile(streams, args.interval)
    text = log.read_text(errors="replace")
    return {"itl": itl, "arrival": arrival, "started": started, "status": status, "phase": phase,
            "eplb_rebalances": text.count("[EPLBManager] rebalance end")}


def phase_profile(streams: list[list[float]], interval: int) -> dict[str, Any]:
    """Mean ITL by decode step modulo the rebalance interval, within one run.

    All streams decode in one batch, so step k of a stream is forward pass k (plus an offset).
    A synchronous weight move stalls one phase of every interval; a background one should not.
    ``stall_ratio`` = the slowest phase's mean / the median phase mean (1.0 = no stall).
    """
    steps = min(len(s) for s in streams) - 1
    itl = np.mean([np.diff(s[: steps + 1]) for s in streams], axis=0)
    means = np.array([itl[p::interval].mean() for p in range(interval)])
    worst = int(means.argmax())
    return {"phase_means_ms": (means * 1000).round(2).tolist(), "worst_phase": worst,
            "stall_ratio": float(means[worst] / np.median(means)),
            "stall_ms": float((means[worst] - np.median(means)) * 1000)}


def stats(values: list[float]) -> dict[str, float]:
    a = np.asarray(values) * 1000
    return {"mean_ms": float(a.mean()), "p50_ms": float(np.percentile(a, 50)),
            "p99_ms": float(np.percentile(a, 99)), "max_ms": float(a.max()), "n": int(a.size)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interval", type=int, default=10, help="forward passes between rebalances")
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=24)
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model = tiny.build("qwen3_moe", tmp / "moe", seed=0, **MODEL)
        runs = {
            "baseline": [],
            "sglang-eplb": ["--enable-eplb", "--eplb-rebalance-num-iterations", str(args.interval)],
            "omni": ["--enable-omni-placement", "--omni-placement-interval", str(args.interval),
                     "--omni-placement-trigger", "1.0", "--omni-placement-margin", "0.0"],
        }
        for name, extra in runs.items():
            print(f"[{name}] starting", flush=True)
            results[name] = run_server(name, model, extra, args, tmp)
            print(f"[{name}] {stats(results[name]['itl'])}", flush=True)
    base = stats(results["baseline"]["itl"])
    summary: dict[str, Any] = {"config": vars(args) | {"model": MODEL}, "servers": {}}
    for name, run in results.items():
        s = stats(run["itl"])
        s["mean_slowdown_vs_baseline"] = s["mean_ms"] / base["mean_ms"]
        s["p99_slowdown_vs_baseline"] = s["p99_ms"] / base["p99_ms"]
        s["phase"] = run["phase"]
        summary["servers"][name] = s
    summary["servers"]["sglang-eplb"]["rebalances"] = results["sglang-eplb"]["eplb_rebalances"]
    migrations = [m for m in (results["omni"]["status"] or {}).get("migrations", [])
                  if m.get("state") == "adopted"]
    windows = [(m["staging_started_unix"], m["switched_unix"]) for m in migrations]
    arrival = np.asarray(results["omni"]["arrival"])
    itl = np.asarray(results["omni"]["itl"])
    during = np.zeros(arrival.size, dtype=bool)
    for lo, hi in windows:
        during |= (arrival >= lo) & (arrival <= hi)
    omni = summary["servers"]["omni"]
    omni["migrations_adopted"] = len(migrations)
    omni["bytes_staged"] = int(sum(m["bytes_staged"] for m in migrations))
    if during.any() and (~during).any():
        omni["itl_during_migration"] = stats(itl[during].tolist())
        omni["itl_outside_migration"] = stats(itl[~during].tolist())
        omni["during_over_outside_mean"] = (omni["itl_during_migration"]["mean_ms"]
                                            / omni["itl_outside_migration"]["mean_ms"])
    print(f"\n{'server':<14}{'mean ms':>9}{'p99 ms':>9}{'max ms':>9}{'mean x':>8}{'p99 x':>8}"
          f"{'stall x':>9}{'stall ms':>10}")
    for name, s in summary["servers"].items():
        print(f"{name:<14}{s['mean_ms']:>9.1f}{s['p99_ms']:>9.1f}{s['max_ms']:>9.1f}"
              f"{s['mean_slowdown_vs_baseline']:>8.3f}{s['p99_slowdown_vs_baseline']:>8.3f}"
              f"{s['phase']['stall_ratio']:>9.3f}{s['phase']['stall_ms']:>10.1f}")
    print("(mean x / p99 x: against the baseline server, measured minutes apart on a shared machine;"
          " stall x: the slowest step phase of each interval against the median phase, same run)")
    print(f"sglang-eplb rebalances: {summary['servers']['sglang-eplb']['rebalances']}; "
          f"omni migrations adopted: {omni['migrations_adopted']} ({omni['bytes_staged'] / 1e6:.1f} MB staged)")
    if "during_over_outside_mean" in omni:
        print(f"omni ITL while staging / otherwise: {omni['itl_during_migration']['mean_ms']:.1f} / "
              f"{omni['itl_outside_migration']['mean_ms']:.1f} ms "
              f"(x{omni['during_over_outside_mean']:.3f})")
    (RESULTS / "migration_stall.json").write_text(json.dumps(summary, indent=2))
    plot(results, RESULTS / "migration_stall.png")
    print(f"wrote {RESULTS / 'migration_stall.json'}")
    return 0


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for name, run in results.items():
        a = np.sort(np.asarray(run["itl"]) * 1000)
        ax.step(a, np.arange(1, a.size + 1) / a.size, where="post", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("inter-token latency (ms)")
    ax.set_ylabel("fraction of tokens")
    ax.set_title("Decode ITL while experts migrate (2 ranks, CPU)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
