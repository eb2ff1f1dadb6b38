"""The paper's ablation on emulated clusters: the whole system against plain SGLang behind the
SGLang router, with and without each technique, in one invocation.

Rows (the paper's Table 2, DeepSeek-R1 on 4 prefill nodes + 1 decode group, 3.5K-in / 1K-out
long-tailed mix, TTFT < 2 s and TPOT < 50 ms):

  full          OmniProxy oas      + OmniPlacement (omni) + OmniAttn pattern
  no_placement  OmniProxy oas      + no placement (contiguous experts)  + pattern
  no_pattern    OmniProxy oas      + OmniPlacement                      + no pattern
  no_oas        SGLang router (smg 1.13, its best policy) + OmniPlacement + pattern
  sglang_best   SGLang router (smg 1.13, its best policy) + SGLang's EPLB (the same spare slots,
                its default period) + no pattern: what an SGLang user runs today, best-configured
  none          SGLang router (smg 1.13, its best policy) + no placement + no pattern

The headline is ``full`` against ``sglang_best``. The pattern term is a shipped pattern file's
(``--attn-pattern``; default the 4K strict file, the largest saving at the paper mix's context
that holds +1 % perplexity on every judged kind of text): its share of compressed layers, sink and
recent window.

Each row is its own emulated cluster (``omniinfer emulate-worker`` with the row's MoE and
pattern terms, see ``omniinfer.emulator.sparse``), the paper mix closed-loop at one
concurrency, every row in turn per repeat (so a slow patch of the shared machine hits all).
smg polls worker loads every second (its smallest interval); OmniProxy is given the same rate.
"The SGLang router's best policy" is chosen in the same invocation: every candidate runs the
``none`` configuration once and the best goodput wins (``--peer-policies``).

    python benchmark/system/ablation.py --quick              # minutes
    python benchmark/system/ablation.py --repeats 3          # the published table

Writes ``results.json``, ``ablation.png`` and the printed table to ``--output-dir``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "proxy"))

from cluster import (  # noqa: E402
    EmulatedCluster,
    free_port,
    omni_router_args,
    omni_router_command,
    smg_router_command,
    start_router,
)
from oas_eval import _shown, to_model_time  # noqa: E402  (model time; paths as results record them)
from tqdm import tqdm  # noqa: E402

from omniinfer.bench.metrics import summarize  # noqa: E402
from omniinfer.bench.runner import run_closed_loop  # noqa: E402
from omniinfer.bench.workloads import WorkloadSpec, paper  # noqa: E402

PAPER_QPM = {"full": 616, "no_placement": 463, "no_pattern": 554, "no_oas": 575, "none": 404}
PATTERNS = HERE.parents[1] / "python" / "omniinfer" / "attn" / "patterns"
DEFAULT_PATTERN = PATTERNS / "smollm2-135m-4k-30.json"
PEER_POLICIES = ("round_robin", "cache_aware", "power_of_two", "least_load", "bucket")


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    router: str  # "oas" or "peer"
    placement: str  # the emulator's --moe-placement
    pattern: bool


ROWS = (Row("full", "oas", "omni", True), Row("no_placement", "oas", "none", True),
        Row("no_pattern", "oas", "omni", False), Row("no_oas", "peer", "omni", True),
        Row("sglang_best", "peer", "eplb", False), Row("none", "peer", "none", False))
NONE_ROW = ROWS[-1]


def pattern_terms(path: Path) -> tuple[float, int, int]:
    """A pattern file's (share of compressed layers, sink, recent): the emulator's pattern term.

    Raises SystemExit with the reason when the file is not a pattern file."""
    try:
        data = json.loads(path.read_text())
        layers = int(data["model"]["num_layers"])
        fraction = len(data["compressed_layers"]) / layers
        return fraction, int(data["sink"]), int(data["recent"])
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError) as exc:
        raise SystemExit(f"--attn-pattern {path}: not a pattern file ({exc})") from None


def emulator_flags(row: Row, args: argparse.Namespace) -> list[str]:
    """The emulator flags of one row, the same on prefill and decode workers: the MoE term is
    always on (what varies is the placement: ``omni`` or SGLang's ``eplb`` with ``--moe-redundant`` spare slots, or
    contiguous experts without spares), the pattern term on or off. The values are the shipped
    ascend profiles' commented ``moe`` / ``attn_pattern`` blocks, except that both roles use
    ``--moe-ranks`` ranks (the decode block's 80 ranks do not divide OLMoE's 64 experts, which
    the contiguous layout needs)."""
    redundant = args.moe_redundant if row.placement != "none" else 0
    flags = ["--moe-share", f"{args.moe_share:g}", "--moe-placement", row.placement,
             "--moe-model", args.moe_model, "--moe-skew", f"{args.moe_skew:g}",
             "--moe-ranks", str(args.moe_ranks), "--moe-redundant", str(redundant),
             "--moe-expert-bytes", "44040192", "--moe-layers", "58",
             "--moe-migration-gb-s", "313.6", "--moe-seed", str(args.seed)]
    if row.pattern:
        flags += ["--attn-compressed-fraction", f"{args.attn_fraction:g}",
                  "--attn-sink", str(args.attn_sink), "--attn-recent", str(args.attn_recent)]
    return flags


def emulator_status(cluster: EmulatedCluster) -> dict[str, Any]:
    """What each emulator reports of its sparse terms after the run (``/server_info``)."""
    import urllib.request

    out = {}
    for url in cluster.urls():
        try:
            with urllib.request.urlopen(url + "/server_info", timeout=10) as r:
                info = json.loads(r.read())
        except OSError:
            continue
        out[url] = info.get("emulator_sparse")
    return out


def run_row(row: Row, peer_policy: str, args: argparse.Namespace, requests: list[Any],
            log_dir: Path) -> dict[str, Any]:
    """One row once: its cluster, its router, the closed loop; summary in model time."""
    profiles = {"prefill": args.prefill_profile, "decode": args.decode_profile}
    decode_kv = ("--max-total-tokens", str(args.decode_kv_tokens)) if args.decode_kv_tokens else ()
    cluster = EmulatedCluster(args.prefill, args.decode, profiles, args.time_scale,
                              log_dir / row.name, extra=tuple(emulator_flags(row, args)),
                              decode_extra=decode_kv)
    port = free_port()
    try:
        if row.router == "oas":
            slo = args.slo_ttft * args.time_scale
            command = omni_router_command(omni_router_args(
                cluster, "oas", "oas", ttft_slo_secs=slo, poll_s=1.0), port)
        else:  # bucket is prefill-only; one decode worker leaves no choice (smg refuses
            # power_of_two over one): round_robin decodes then
            alone = len(cluster.decode) == 1 or peer_policy == "bucket"
            decode = "round_robin" if alone else peer_policy
            command = smg_router_command(cluster, peer_policy, decode, port)
        router = start_router(command, port, log_dir / f"{row.name}-router.log")
        try:
            results, duration = asyncio.run(run_closed_loop(
                f"http://127.0.0.1:{port}", requests, args.concurrency, progress=False,
                timeout_s=1200))
        finally:
            router.stop()
        status = emulator_status(cluster)
    finally:
        cluster.stop()
    model = to_model_time(results, args.time_scale)
    summary = summarize(model, duration / args.time_scale, args.slo_ttft, args.slo_tpot)
    return {"row": row.name, "router": "oas" if row.router == "oas" else f"smg:{peer_policy}",
            "summary": summary, "errors": [r.error for r in model if not r.ok][:3],
            "emulator": status}


def _stat(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _values(runs: list[dict[str, Any]], row: str) -> list[float]:
    return [float(r["summary"]["goodput_requests_per_minute"] or 0.0) for r in runs
            if r["row"] == row and "summary" in r] or [float("nan")]


def table(runs: list[dict[str, Any]], peer: str) -> tuple[str, dict[str, Any]]:
    by_row: dict[str, dict[str, Any]] = {}
    for row in ROWS:
        mine = [r["summary"] for r in runs if r["row"] == row.name and "summary" in r]
        if not mine:
            continue
        by_row[row.name] = {key: _stat([float(s[key] or 0.0) for s in mine]) for key in (
            "requests_per_minute", "goodput_requests_per_minute", "median_ttft_ms",
            "p99_ttft_ms", "median_tpot_ms")}
    base = by_row.get("none", {}).get("goodput_requests_per_minute", {}).get("median")
    lines = [f"{'row':<14}{'router':<20}{'QPM':>8}{'goodput QPM (min-max)':>26}"
             f"{'TTFT p50/p99 ms':>18}{'TPOT p50':>10}{'x none':>8}{'paper QPM':>11}"
             f"{'paper x':>9}"]
    for row in ROWS:
        if row.name not in by_row:
            continue
        s = by_row[row.name]
        good = s["goodput_requests_per_minute"]
        ratio = good["median"] / base if base else float("nan")
        router = "oas" if row.router == "oas" else f"smg:{peer}"
        spread = f"{good['median']:.0f} ({good['min']:.0f}-{good['max']:.0f})"
        ttft = f"{s['median_ttft_ms']['median']:.0f}/{s['p99_ttft_ms']['median']:.0f}"
        paper_qpm = PAPER_QPM.get(row.name)
        paper = (f"{paper_qpm:>11}{paper_qpm / PAPER_QPM['none']:>9.2f}" if paper_qpm
                 else f"{'-':>11}{'-':>9}")
        lines.append(
            f"{row.name:<14}{router:<20}{s['requests_per_minute']['median']:>8.0f}"
            f"{spread:>26}{ttft:>18}{s['median_tpot_ms']['median']:>10.1f}{ratio:>8.2f}"
            f"{paper}")
        by_row[row.name]["x_none"] = ratio
    best = by_row.get("sglang_best", {}).get("goodput_requests_per_minute")
    full = by_row.get("full", {}).get("goodput_requests_per_minute")
    if best and full:
        ratios = sorted(f / b for f in _values(runs, "full") for b in _values(runs, "sglang_best"))
        by_row["full"]["x_sglang_best"] = full["median"] / best["median"]
        lines.append(f"full / sglang_best: {full['median'] / best['median']:.2f}x goodput "
                     f"(every pair of repeats {ratios[0]:.2f}-{ratios[-1]:.2f}x)")
    return "\n".join(lines), by_row


def plot(by_row: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.name for r in ROWS if r.name in by_row]
    ours = [by_row[n]["goodput_requests_per_minute"]["median"] for n in names]
    lo = [o - by_row[n]["goodput_requests_per_minute"]["min"] for n, o in zip(names, ours, strict=True)]
    hi = [by_row[n]["goodput_requests_per_minute"]["max"] - o for n, o in zip(names, ours, strict=True)]
    base = by_row.get("none", {}).get("goodput_requests_per_minute", {}).get("median") or 1.0
    fig, ax = plt.subplots(figsize=(7, 4))
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [o / base for o in ours], 0.4, yerr=[
        [v / base for v in lo], [v / base for v in hi]], label="emulated (goodput, x none)")
    ax.bar([i + 0.2 for i in x], [PAPER_QPM.get(n, 0) / PAPER_QPM["none"] for n in names], 0.4,
           label="paper Table 2 (QPM, x none)")
    ax.set_xticks(list(x), names, rotation=20, fontsize=8)
    ax.set_ylabel("x the 'none' row")
    ax.set_title("OmniInfer ablation")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


SENSITIVITY = (("moe_share", 0.5), ("moe_share", 1.5), ("moe_skew", 0.5), ("moe_skew", 1.5),
               ("decode_kv_tokens", 0.5), ("decode_kv_tokens", 1.5))


def sensitivity(args: argparse.Namespace, peer: str, requests: list[Any], log_dir: Path,
                base: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """Every row once more with one parameter moved by a factor; each row's goodput as a
    multiple of the same run's ``none`` row, beside the main table's."""
    out = []
    for name, factor in tqdm(SENSITIVITY, desc="sensitivity"):
        moved = argparse.Namespace(**vars(args))
        value = getattr(args, name) or 0
        setattr(moved, name, type(value)(value * factor))
        runs = [run_row(row, peer, moved, requests, log_dir / f"{name}x{factor:g}")
                for row in ROWS if row.name in args.sensitivity_rows]
        for run in runs:
            run["repeat"] = 0
        _, by_row = table(runs, peer)
        out.append({"parameter": name, "factor": factor, "value": getattr(moved, name),
                    "x_none": {k: v.get("x_none") for k, v in by_row.items()},
                    "full_x_sglang_best": by_row.get("full", {}).get("x_sglang_best"),
                    "runs": runs})
    names = [r.name for r in ROWS if r.name in args.sensitivity_rows]
    lines = [f"{'moved':<26}" + "".join(f"{n:>14}" for n in names) + f"{'full/best':>11}"]
    lines.append(f"{'(main table)':<26}" + "".join(
        f"{base.get(n, {}).get('x_none', float('nan')):>14.2f}" for n in names)
        + f"{base.get('full', {}).get('x_sglang_best') or float('nan'):>11.2f}")
    for item in out:
        label = f"{item['parameter']} x{item['factor']:g} ({item['value']:g})"
        lines.append(f"{label:<26}" + "".join(
            f"{(item['x_none'].get(n) or float('nan')):>14.2f}" for n in names)
            + f"{item['full_x_sglang_best'] or float('nan'):>11.2f}")
    return "\n".join(lines), out


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> int:
    signal.signal(signal.SIGTERM, _interrupt)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--prefill-profile", default="ascend-r1-prefill")
    p.add_argument("--decode-profile", default="ascend-r1-decode")
    p.add_argument("--prefill", type=int, default=4)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--time-scale", type=float, default=2.0)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--output-scale", type=float, default=0.05)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--peer-policies", default=",".join(PEER_POLICIES))
    p.add_argument("--moe-share", type=float, default=0.55,
                   help="routed experts' share of a pass (R1: 20.4B of 37B active parameters)")
    p.add_argument("--moe-ranks", type=int, default=32)
    p.add_argument("--moe-redundant", type=int, default=32)
    p.add_argument("--moe-model", default="olmoe")
    p.add_argument("--moe-skew", type=float, default=1.0)
    p.add_argument("--attn-pattern", type=Path, default=DEFAULT_PATTERN,
                   help="the pattern file whose compressed-layer share, sink and recent window "
                   "the pattern term takes")
    p.add_argument("--decode-kv-tokens", type=int, default=None,
                   help="the decode workers' KV pool (--max-total-tokens); default: the "
                   "profile's, which no run here fills")
    p.add_argument("--sensitivity", action="store_true",
                   help="then every row once more with the MoE share, the routing skew and the "
                   "decode KV budget each moved by -50 %% and +50 %%")
    p.add_argument("--sensitivity-rows", default=",".join(r.name for r in ROWS),
                   help="the rows the sensitivity runs repeat (comma-separated)")
    p.add_argument("--slo-ttft", type=float, default=2.0)
    p.add_argument("--slo-tpot", type=float, default=0.050)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", type=Path, default=HERE.parent / "results" / "system")
    args = p.parse_args()
    if args.quick:
        args.num_requests = min(args.num_requests, 96)
        args.peer_policies = "round_robin,cache_aware"
    args.attn_fraction, args.attn_sink, args.attn_recent = pattern_terms(args.attn_pattern)
    args.sensitivity_rows = tuple(args.sensitivity_rows.split(","))
    unknown = set(args.sensitivity_rows) - {r.name for r in ROWS}
    if unknown:
        raise SystemExit(f"--sensitivity-rows: no row {sorted(unknown)[0]!r}")
    out = args.output_dir
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    requests = paper(WorkloadSpec(num_requests=args.num_requests, seed=args.seed,
                                  vocab_size=128000, output_scale=args.output_scale,
                                  max_total_len=16000))
    t0 = time.monotonic()
    candidates = args.peer_policies.split(",")
    runs: list[dict[str, Any]] = []
    peer_runs = []
    for policy in tqdm(candidates if len(candidates) > 1 else [], desc="peer policies"):
        try:
            peer_runs.append(run_row(NONE_ROW, policy, args, requests, logs))
        except RuntimeError as exc:  # a policy smg refuses here is no candidate
            print(f"  smg:{policy:<14} FAILED: {str(exc)[:200]}", flush=True)
            continue
        peer_runs[-1]["repeat"] = -1
        print(f"  smg:{policy:<14} goodput QPM "
              f"{peer_runs[-1]['summary']['goodput_requests_per_minute']:.0f}", flush=True)
    if len(candidates) == 1:  # the best policy named: no selection runs
        peer = candidates[0]
    elif not peer_runs:
        raise SystemExit("no peer policy ran")
    else:
        best = max(peer_runs, key=lambda r: r["summary"]["goodput_requests_per_minute"])
        peer = best["router"].split(":", 1)[1]
    for repeat in tqdm(range(args.repeats), desc="repeats"):
        for row in ROWS:
            run = run_row(row, peer, args, requests, logs)  # "none" again: no winner's curse
            run["repeat"] = repeat
            runs.append(run)
            (out / "results.partial.json").write_text(json.dumps(runs, default=str))
    text, by_row = table(runs, peer)
    meta = {k: (_shown(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    meta["wall_s"] = time.monotonic() - t0
    meta["peer_policy"] = peer
    (out / "results.json").write_text(json.dumps(
        {"meta": meta, "peer_selection": peer_runs, "runs": runs, "rows": by_row}, indent=1,
        default=str))
    plot(by_row, out / "ablation.png")
    moved_text, moved = ("", [])
    if args.sensitivity:
        if not args.decode_kv_tokens:
            raise SystemExit("--sensitivity moves the decode KV budget: give --decode-kv-tokens")
        moved_text, moved = sensitivity(args, peer, requests, logs, by_row)
        (out / "results.json").write_text(json.dumps(
            {"meta": meta, "peer_selection": peer_runs, "runs": runs, "rows": by_row,
             "sensitivity": moved}, indent=1, default=str))
    header = (f"Ablation: {args.prefill}P{args.decode}D emulated {args.prefill_profile}/"
              f"{args.decode_profile}, paper mix closed-loop c={args.concurrency}, "
              f"{args.repeats} repeat(s), SGLang router = smg 1.13 {peer} (best of "
              f"{', '.join(candidates)})")
    share = by_row.get("none", {})
    met = (share.get("goodput_requests_per_minute", {}).get("median", 0.0)
           / max(1e-9, share.get("requests_per_minute", {}).get("median", 0.0)))
    header += f"\nthe 'none' row meets the SLO for {met:.0%} of its requests"
    if moved_text:
        text += "\n\nSensitivity (goodput x the same run's 'none' row):\n" + moved_text
    print(header)
    print(text)
    (out / "table.txt").write_text(header + "\n" + text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
