"""Memory vs imbalance: layer-wise budgets (ours) vs uniform EPLB at equal total memory.

Run: .venv/bin/python benchmark/placement/memory_curve.py
The 18 (domain, layer) count matrices of OLMoE (6 domains x layers 0/7/15) are planned together
as one 18-layer model, so layers differ in imbalance as the layers of a real model do. Memory is
the number of redundant slots per device per layer, averaged over layers. SGLang's uniform
layout exists only where R divides K (whole slots per device); ours exists at every budget.
Writes results/memory_curve.json and results/memory_curve.png.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tqdm import tqdm

from omniinfer.placement.loads import read_domain_counts
from omniinfer.placement.peer import eplb_plan
from omniinfer.placement.static import plan_layerwise, plan_static

RESULTS = Path(__file__).resolve().parent / "results"
PER_DEVICE = [0.125, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0]


def curve(counts: np.ndarray, devices: int) -> dict:
    layers = counts.shape[0]
    rows = []
    for per in tqdm(PER_DEVICE, desc=f"R={devices}"):
        total = int(round(per * devices * layers))
        placement, budget = plan_layerwise(counts, devices, total)
        row = {
            "per_device": per,
            "total_redundant": total,
            "ours_layerwise": float(placement.imbalance(counts).mean()),
            "budget_min": int(budget.min()),
            "budget_max": int(budget.max()),
        }
        if float(per).is_integer():
            k = int(per * devices)
            row["eplb_uniform"] = float(eplb_plan(counts, devices, k).imbalance(counts).mean())
            row["ours_uniform"] = float(plan_static(counts, devices, k).imbalance(counts).mean())
        rows.append(row)
    base = float(eplb_plan(counts, devices, 0).imbalance(counts).mean())
    return {"devices": devices, "no_redundancy_eplb": base, "points": rows}


def main() -> None:
    domains = read_domain_counts(model="olmoe")
    counts = np.concatenate(list(domains.values()))
    result = {
        "layers": int(counts.shape[0]),
        "experts": int(counts.shape[1]),
        "curves": [curve(counts, r) for r in (16, 32)],
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "memory_curve.json").write_text(json.dumps(result, indent=2) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, c in zip(axes, result["curves"], strict=True):
        pts = c["points"]
        ax.plot(
            [p["per_device"] for p in pts],
            [p["ours_layerwise"] for p in pts],
            "o-",
            label="ours, layer-wise budgets",
        )
        uni = [p for p in pts if "eplb_uniform" in p]
        ax.plot(
            [p["per_device"] for p in uni],
            [p["eplb_uniform"] for p in uni],
            "s--",
            label="SGLang deepseek EPLB, uniform K",
        )
        ax.plot(
            [p["per_device"] for p in uni],
            [p["ours_uniform"] for p in uni],
            "^:",
            label="ours, uniform K",
        )
        ax.set_title(f"OLMoE, 18 layers x 64 experts, R={c['devices']} devices")
        ax.set_xlabel("redundant slots per device per layer (memory)")
        ax.set_ylabel("mean B over layers (known load)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "memory_curve.png", dpi=110)

    print("Memory vs imbalance (mean B over 18 layers, known load)")
    print(
        f"{'R':>3} {'slots/dev':>9} {'ours layer-wise':>15} "
        f"{'ours uniform':>12} {'EPLB uniform':>12}"
    )
    for c in result["curves"]:
        for p in c["points"]:
            print(
                f"{c['devices']:>3} {p['per_device']:>9} {p['ours_layerwise']:>15.4f} "
                f"{p.get('ours_uniform', float('nan')):>12.4f} "
                f"{p.get('eplb_uniform', float('nan')):>12.4f}"
            )
        by = {p["per_device"]: p for p in c["points"]}
        ours_half, eplb_full = by[0.5]["ours_layerwise"], by[1.0]["eplb_uniform"]
        verdict = "beats" if ours_half < eplb_full else "does NOT beat"
        print(
            f"R={c['devices']}: ours at half memory (0.5 slot/device) {ours_half:.4f} {verdict} "
            f"uniform EPLB at 1 slot/device {eplb_full:.4f}"
        )


if __name__ == "__main__":
    main()
