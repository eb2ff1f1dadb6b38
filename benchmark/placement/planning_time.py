"""Planning time at DeepSeek-V3 scale: 58 MoE layers x 256 experts, 64 devices + 64 redundant.

Run: .venv/bin/python benchmark/placement/planning_time.py
Both planners run in the same process on the same counts; the time is the median of repeats.
Counts: each layer joins four real OLMoE rows (random domain and layer, experts shuffled, with
lognormal noise) into 256 experts; a second, synthetic heavy-tailed set (gamma) is also timed.
SGLang's algorithm is given one node and no expert groups (its global policy).
Writes results/planning_time.json.
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from omniinfer.placement.loads import read_domain_counts
from omniinfer.placement.peer import eplb_plan
from omniinfer.placement.static import plan_static

RESULTS = Path(__file__).resolve().parent / "results"
LAYERS, EXPERTS, DEVICES, REDUNDANT, NODES, REPEATS = 58, 256, 64, 64, 8, 5


def olmoe_derived(rng: np.random.Generator) -> np.ndarray:
    rows = np.concatenate(list(read_domain_counts(model="olmoe").values()))
    out = np.empty((LAYERS, EXPERTS))
    for layer in range(LAYERS):
        parts = [rng.permutation(rows[rng.integers(len(rows))]) for _ in range(EXPERTS // 64)]
        out[layer] = np.concatenate(parts) * rng.lognormal(0.0, 0.3, EXPERTS)
    return out


def timed(fn, repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times)), result


def main() -> None:
    rng = np.random.default_rng(0)
    workloads = {
        "olmoe-derived": olmoe_derived(rng),
        "gamma(0.7)": rng.gamma(0.7, 1000.0, size=(LAYERS, EXPERTS)),
    }
    eplb_plan(workloads["olmoe-derived"][:1], DEVICES, REDUNDANT)  # load torch + SGLang once
    rows = {}
    for name, counts in tqdm(workloads.items(), desc="workloads"):
        ours_s, ours = timed(lambda c=counts: plan_static(c, DEVICES, REDUNDANT), REPEATS)
        topo_s, _ = timed(lambda c=counts: plan_static(c, DEVICES, REDUNDANT, NODES), REPEATS)
        eplb_s, eplb = timed(lambda c=counts: eplb_plan(c, DEVICES, REDUNDANT), REPEATS)
        b_ours, b_eplb = ours.imbalance(counts), eplb.imbalance(counts)
        rows[name] = {
            "ours_seconds": ours_s,
            "ours_with_topology_remap_seconds": topo_s,
            "eplb_seconds": eplb_s,
            "ratio_ours_over_eplb": ours_s / eplb_s,
            "ours_mean_b": float(b_ours.mean()),
            "eplb_mean_b": float(b_eplb.mean()),
            "worst_layer_gap_ours_minus_eplb": float((b_ours - b_eplb).max()),
        }
    result = {
        "layers": LAYERS,
        "experts": EXPERTS,
        "devices": DEVICES,
        "redundant": REDUNDANT,
        "nodes_for_remap": NODES,
        "repeats": REPEATS,
        "cpu": platform.processor() or platform.machine(),
        "workloads": rows,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "planning_time.json").write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"Planning time, {LAYERS} layers x {EXPERTS} experts, {DEVICES} devices + {REDUNDANT} "
        f"redundant (median of {REPEATS})"
    )
    print(
        f"{'counts':<14} {'ours s':>7} {'+remap s':>8} {'EPLB s':>7} {'ours/EPLB':>9} "
        f"{'ours B':>7} {'EPLB B':>7}"
    )
    for name, r in rows.items():
        print(
            f"{name:<14} {r['ours_seconds']:>7.3f} {r['ours_with_topology_remap_seconds']:>8.3f} "
            f"{r['eplb_seconds']:>7.3f} {r['ratio_ours_over_eplb']:>9.2f} "
            f"{r['ours_mean_b']:>7.4f} {r['eplb_mean_b']:>7.4f}"
        )


if __name__ == "__main__":
    main()
