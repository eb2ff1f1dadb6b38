"""``omniinfer placement plan|simulate``: the planner from the command line.

``plan`` writes a file SGLang's ``--init-expert-location`` loads as-is (only the key
``physical_to_logical_map``: SGLang passes every key of that file on as an argument) and the
per-layer figures to ``<output stem>.stats.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from omniinfer.placement.dynamic import PREDICTORS, DynamicConfig
from omniinfer.placement.layout import Placement, PlacementError, replica_counts
from omniinfer.placement.loads import load_counts, read_domain_counts
from omniinfer.placement.simulate import (
    EXPERT_BYTES,
    POLICIES,
    DriftConfig,
    simulate,
    write_outputs,
)
from omniinfer.placement.static import (
    check_shape,
    cross_node_fraction,
    plan_layerwise,
    plan_static,
)


def _add_fleet(parser: argparse.ArgumentParser, counts: str, counts_required: bool = True) -> None:
    """The expert counts both commands read (``counts``: what ``--counts`` takes) and the EP
    devices and redundant slots they plan for."""
    parser.add_argument("--counts", type=Path, required=counts_required, default=None,
                        help=counts)
    parser.add_argument("--num-devices", type=int, required=True, help="R: EP devices")
    parser.add_argument("--num-redundant-experts", type=int, required=True,
                        help="K: redundant slots per layer (SGLang --ep-num-redundant-experts)")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("placement", help="OmniPlacement: expert placement planner")
    sub = p.add_subparsers(dest="placement_command", required=True)

    plan = sub.add_parser("plan", help="plan a placement from recorded expert counts")
    _add_fleet(plan, counts="SGLang expert-distribution dump (.pt), JSON with logical_count, "
               "or CSV")
    plan.add_argument("--num-nodes", type=int, default=1, help="N: nodes, for the topology remap")
    plan.add_argument(
        "--fold",
        choices=("sum", "window", "ema"),
        default="sum",
        help="how recorded steps become one load matrix",
    )
    plan.add_argument("--window", type=int, default=0, help="steps kept by --fold window")
    plan.add_argument("--alpha", type=float, default=0.3, help="newest-step weight of --fold ema")
    plan.add_argument(
        "--layerwise",
        action="store_true",
        help="spread L*K redundant slots over layers by imbalance (not loadable "
        "by SGLang, which needs the same slot count in every layer)",
    )
    plan.add_argument("--output", type=Path, required=True, help="plan JSON to write")
    plan.set_defaults(func=run_plan)

    sim = sub.add_parser("simulate", help="judge policies on a drifting workload of real counts")
    sim.add_argument("--model", default="olmoe", help="model inside the counts file")
    _add_fleet(sim, counts="per-domain counts JSON (default: the OLMoE routing counts shipped)",
               counts_required=False)
    sim.add_argument("--windows", type=int, default=120)
    sim.add_argument(
        "--routed-per-window",
        type=int,
        default=32768,
        help="(token, top-k slot) assignments per window",
    )
    sim.add_argument("--regime", type=int, default=30, help="windows between regime shifts")
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--period", type=int, default=10, help="windows between eplb-periodic runs")
    sim.add_argument("--policies", default=",".join(POLICIES), help="comma-separated")
    sim.add_argument("--predictor", choices=sorted(PREDICTORS), default=DynamicConfig.predictor)
    sim.add_argument("--trigger", type=float, default=DynamicConfig.trigger)
    sim.add_argument("--margin", type=float, default=DynamicConfig.margin)
    sim.add_argument("--max-moves", type=int, default=DynamicConfig.max_moves)
    sim.add_argument(
        "--expert-bytes",
        type=int,
        default=None,
        help="bytes of one expert's weights (default: bf16 size for --model)",
    )
    sim.add_argument("--output", type=Path, required=True, help="folder for summary.json + PNG")
    sim.add_argument("--no-progress", action="store_true")
    sim.set_defaults(func=run_simulate)


def _fail(message: str) -> int:
    print(f"omniinfer: error: {message}", file=sys.stderr)
    return 2


def trivial_placement(
    num_layers: int, num_experts: int, num_devices: int, num_redundant: int
) -> Placement:
    """SGLang's default layout: physical slot p holds expert p % E."""
    slots = np.arange(num_experts + num_redundant) % num_experts
    return Placement.from_physical_to_logical_map(
        np.tile(slots, (num_layers, 1)), num_devices, num_experts
    )


def run_plan(args: argparse.Namespace) -> int:
    try:
        counts = load_counts(args.counts, args.fold, args.window, args.alpha)
        num_layers, num_experts = counts.shape
        check_shape(num_experts, args.num_devices, args.num_redundant_experts, args.num_nodes)
        start = time.perf_counter()
        if args.layerwise:
            placement, budget = plan_layerwise(
                counts, args.num_devices, args.num_redundant_experts * num_layers, args.num_nodes
            )
        else:
            placement = plan_static(
                counts, args.num_devices, args.num_redundant_experts, args.num_nodes
            )
            budget = np.full(num_layers, args.num_redundant_experts)
        seconds = time.perf_counter() - start
    except PlacementError as exc:
        return _fail(str(exc))
    before = trivial_placement(
        num_layers, num_experts, args.num_devices, args.num_redundant_experts
    ).imbalance(counts)
    after = placement.imbalance(counts)
    rows = []
    for layer in range(num_layers):
        slots = placement.slots[layer]
        rows.append(
            {
                "layer": layer,
                "b_before": round(float(before[layer]), 4),
                "b_after": round(float(after[layer]), 4),
                "redundant_slots": int(budget[layer]),
                "max_copies": int(replica_counts(slots, num_experts).max()),
                "cross_node_fraction": round(
                    cross_node_fraction(slots, counts[layer], args.num_nodes), 4
                ),
            }
        )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    if args.layerwise:
        doc = {"device_experts": placement.slots.tolist(), "num_devices": args.num_devices}
    else:
        doc = {"physical_to_logical_map": placement.physical_to_logical_map()}
    args.output.write_text(json.dumps(doc) + "\n")
    stats_path = args.output.with_name(args.output.stem + ".stats.json")
    stats = {
        "counts": str(args.counts),
        "num_devices": args.num_devices,
        "num_redundant_experts": args.num_redundant_experts,
        "num_nodes": args.num_nodes,
        "layerwise": bool(args.layerwise),
        "planning_seconds": round(seconds, 4),
        "mean_b_before": round(float(before.mean()), 4),
        "mean_b_after": round(float(after.mean()), 4),
        "layers": rows,
    }
    stats_path.write_text(json.dumps(stats, indent=2) + "\n")
    print(
        f"{'layer':>5} {'B before':>9} {'B after':>8} {'redundant':>9} "
        f"{'max copies':>10} {'x-node':>7}"
    )
    for r in rows:
        print(
            f"{r['layer']:>5} {r['b_before']:>9.4f} {r['b_after']:>8.4f} {r['redundant_slots']:>9} "
            f"{r['max_copies']:>10} {r['cross_node_fraction']:>7.3f}"
        )
    print(f" mean {before.mean():>9.4f} {after.mean():>8.4f}   planned in {seconds:.3f} s")
    print(f"wrote {args.output} and {stats_path}")
    return 0


def run_simulate(args: argparse.Namespace) -> int:
    try:
        domains = read_domain_counts(args.counts, args.model)
        policies = tuple(p for p in args.policies.split(",") if p)
        if args.period < 1:
            raise PlacementError(f"--period must be >= 1, got {args.period}")
        drift = DriftConfig(
            windows=args.windows,
            routed_per_window=args.routed_per_window,
            regime=args.regime,
            seed=args.seed,
        )
        expert_bytes = args.expert_bytes
        if expert_bytes is None:
            expert_bytes = EXPERT_BYTES.get(args.model, 0)
        dynamic = DynamicConfig(
            trigger=args.trigger,
            margin=args.margin,
            max_moves=args.max_moves,
            predictor=args.predictor,
        )
        result = simulate(
            domains,
            args.num_devices,
            args.num_redundant_experts,
            drift,
            policies,
            period=args.period,
            dynamic=dynamic,
            expert_bytes=expert_bytes,
            progress=not args.no_progress,
        )
    except PlacementError as exc:
        return _fail(str(exc))
    paths = write_outputs(result, args.output)
    print(f"{'policy':<14} {'mean B':>7} {'p99 B':>7} {'moved':>7} {'GB moved':>9}")
    for name, row in result["policies"].items():
        moved = row.get("experts_migrated")
        gb = "" if moved is None else f"{row['bytes_migrated'] / 1e9:9.2f}"
        print(
            f"{name:<14} {row['mean_b']:>7.4f} {row['p99_b']:>7.4f} "
            f"{'' if moved is None else moved:>7} {gb:>9}"
        )
    print("wrote " + " and ".join(str(p) for p in paths))
    return 0
