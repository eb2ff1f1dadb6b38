"""OmniPlacement against SGLang's EPLB in the emulator's MoE clock, under drift of several speeds.

Both placements run in :class:`omniinfer.emulator.sparse.MoeClock`, the term every emulated
worker's passes are scaled by, driven here pass by pass for ``--passes`` decode steps without a
cluster around it (so hours of serving take seconds):

  eplb   SGLang's deepseek EPLB on the counts since its last rebalance, every ``--eplb-period``
         windows of 100 passes (SGLang 0.5.23: ``--eplb-rebalance-num-iterations`` 1000 and a
         recorder buffer of the same length), starting from a plan made on a recorded
         distribution (``--init-expert-location``, its best configuration; SGLang's default
         start is the trivial layout); every rebalance stalls the pass for bytes / bandwidth.
  omni   the served controller (``--enable-omni-placement`` defaults) after every window; a new
         placement is staged in the background and switched once its bytes have moved.
  oracle each window planned on that window's own counts, free: a floor no placement reaches,
         which bounds the step ratio any placement can have against EPLB.

A pass's time is ``pass_ms x factor + stall`` with ``factor = (1 - share) + share x B`` (the
emulator's formula). The step ratio omni / eplb is the ratio of the mean pass times, stalls
included; "no stalls" is the same ratio with EPLB's stalls left out (what balance alone gives). Loads: OLMoE's real per-domain router counts replayed as a drifting mixture; three
drift speeds (ASSUMPTION: no public trace of how fast a serving mix drifts) --

  slow     a new regime every 60 windows, random walk 0.08 per window
  default  every 30, 0.15 (``DriftConfig``'s defaults, which the emulated workers use)
  fast     every 10, 0.30

-- and two spare budgets against EPLB's: the same slots, and half of them for omni. The shape is
OLMoE's 64 experts on 16 EP ranks, 32 spare slots for EPLB (6 slots per rank) and 32 or 16
for omni (5 per rank), the R1 sizes of ``ablation.py`` otherwise (58
MoE layers, 44 MB per expert, 313.6 GB/s, MoE share 0.55). The decode pass is 12.4 ms (the P50
TPOT of the ablation's full row; ASSUMPTION for the hour figures).

    python benchmark/placement/vs_eplb.py                 # seeds 0-4 judged, about 1 min
    python benchmark/placement/vs_eplb.py --seeds 100,101 # the tuning seeds

Prints a table; writes ``results/vs_eplb.json`` and ``results/vs_eplb.png`` (B over time for both
at each speed, seed 0: the shape of the paper's Figure 3).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from omniinfer.bench.records import recorded_args, write_results
from omniinfer.emulator.sparse import MoeClock, MoeConfig
from omniinfer.placement.simulate import DriftConfig

RESULTS = Path(__file__).resolve().parent / "results"
SPEEDS = {"slow": (60, 0.08), "default": (30, 0.15), "fast": (10, 0.30)}


def run_clock(placement: str, redundant: int, speed: str, seed: int,
              args: argparse.Namespace) -> dict[str, Any]:
    """One placement on one drifting stream for ``args.passes`` passes: time, B, bytes."""
    regime, walk = SPEEDS[speed]
    config = MoeConfig(share=args.share, placement=placement, model="olmoe", ranks=args.ranks,
                       redundant=redundant, window_steps=100, eplb_period=args.eplb_period,
                       expert_bytes=args.expert_bytes, layers=args.layers,
                       migration_gb_s=args.gb_s, seed=seed)
    clock = MoeClock(config, drift=DriftConfig(regime=regime, drift=walk))
    pass_s = args.pass_ms / 1000.0
    now = busy = 0.0
    b_per_window: list[float] = []
    window_b: list[float] = []
    for _ in range(args.passes):
        step = clock.step(now)
        if step.window != len(b_per_window) + 1 and window_b:
            b_per_window.append(float(np.mean(window_b)))
            window_b = []
        window_b.append(step.b)
        took = step.stall_s + pass_s * step.factor
        busy += took
        now += took
    hours = now / 3600.0
    status = clock.status()
    return {"placement": placement, "redundant": redundant, "speed": speed, "seed": seed,
            "mean_pass_ms": 1000.0 * busy / args.passes,
            "compute_ms": 1000.0 * (busy - status["stall_s"]) / args.passes,
            "mean_b": status["b_mean"],
            "stall_s": status["stall_s"], "stall_share": status["stall_s"] / now,
            "rebalances": status["rebalances"], "gb_per_hour": status["bytes_moved"] / 1e9 / hours,
            "b_per_window": b_per_window}



def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0,1,2,3,4")
    p.add_argument("--passes", type=int, default=20_000, help="decode passes per run (200 windows)")
    p.add_argument("--ranks", type=int, default=16)
    p.add_argument("--eplb-spares", type=int, default=32)
    p.add_argument("--eplb-period", type=int, default=10, help="windows of 100 passes")
    p.add_argument("--share", type=float, default=0.55)
    p.add_argument("--pass-ms", type=float, default=12.4)
    p.add_argument("--layers", type=int, default=58)
    p.add_argument("--expert-bytes", type=int, default=44_040_192)
    p.add_argument("--gb-s", type=float, default=313.6)
    p.add_argument("--output", type=Path, default=RESULTS / "vs_eplb.json")
    args = p.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    setups = [("eplb", args.eplb_spares), ("omni", args.eplb_spares), ("omni", args.eplb_spares // 2),
              ("oracle", args.eplb_spares)]
    jobs = [(speed, seed, placement, spares) for speed in SPEEDS for seed in seeds
            for placement, spares in setups]
    runs = [run_clock(placement, spares, speed, seed, args)
            for speed, seed, placement, spares in tqdm(jobs, desc="clock runs")]
    rows = []
    for speed in SPEEDS:
        eplb = {r["seed"]: r for r in runs if r["speed"] == speed and r["placement"] == "eplb"}
        for placement, spares in setups:
            mine = [r for r in runs if r["speed"] == speed and r["placement"] == placement
                    and r["redundant"] == spares]
            ratios = [r["mean_pass_ms"] / eplb[r["seed"]]["mean_pass_ms"] for r in mine]
            no_stall = [r["compute_ms"] / eplb[r["seed"]]["compute_ms"] for r in mine]
            rows.append({
                "speed": speed, "placement": placement, "spares": spares,
                "mean_b": statistics.mean(r["mean_b"] for r in mine),
                "mean_pass_ms": statistics.mean(r["mean_pass_ms"] for r in mine),
                "step_vs_eplb": statistics.mean(ratios), "step_vs_eplb_max": max(ratios),
                "step_vs_eplb_without_stalls": statistics.mean(no_stall),
                "stall_share": statistics.mean(r["stall_share"] for r in mine),
                "gb_per_hour": statistics.mean(r["gb_per_hour"] for r in mine)})
    print(f"\n{args.ranks} EP ranks, OLMoE counts, {args.passes} passes of {args.pass_ms} ms, "
          f"MoE share {args.share}, seeds {seeds} (means; step ratio worst seed in brackets)")
    print(f"{'drift':<8} {'placement':<10} {'spares':>6} {'mean B':>7} {'pass ms':>8} "
          f"{'x eplb':>13} {'no stalls':>9} {'stalled':>8} {'GB/hour':>8}")
    for row in rows:
        print(f"{row['speed']:<8} {row['placement']:<10} {row['spares']:>6} {row['mean_b']:>7.3f} "
              f"{row['mean_pass_ms']:>8.2f} {row['step_vs_eplb']:>6.3f} ({row['step_vs_eplb_max']:.3f})"
              f" {row['step_vs_eplb_without_stalls']:>9.3f} {row['stall_share']:>7.2%}"
              f" {row['gb_per_hour']:>8.0f}")
    write_results(args.output, {"args": recorded_args(args, RESULTS.parents[2]),
                                "rows": rows, "runs": runs})
    plot(runs, seeds[0], setups, args.output.with_suffix(".png"))
    print(f"wrote {args.output} and {args.output.with_suffix('.png').name}")
    return 0


def plot(runs: list[dict[str, Any]], seed: int, setups: list[tuple[str, int]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(SPEEDS), 1, figsize=(9, 2.6 * len(SPEEDS)), sharex=True)
    for ax, speed in zip(axes, SPEEDS, strict=True):
        for placement, spares in setups:
            run = next(r for r in runs if r["speed"] == speed and r["seed"] == seed
                       and r["placement"] == placement and r["redundant"] == spares)
            ax.plot(range(1, len(run["b_per_window"]) + 1), run["b_per_window"], lw=1,
                    label=f"{placement}, {spares} spares (mean B {run['mean_b']:.3f})")
        regime = SPEEDS[speed][0]
        for t in range(regime, len(run["b_per_window"]) + 1, regime):
            ax.axvline(t, color="grey", lw=0.5, ls=":")
        ax.set_ylabel("B")
        ax.set_title(f"drift {speed}: regime every {regime} windows, walk {SPEEDS[speed][1]}",
                     fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("window of 100 decode passes (dotted: regime shift)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
