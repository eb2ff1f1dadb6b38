"""Tables, criteria and plots of ``prefix_eval.py`` results (also runnable on a saved results.json).

    python benchmark/proxy/prefix_report.py benchmark/results/proxy/prefix/results.json [--docs docs/benchmarks.md]

A run row is one (cluster, workload, rate, target, repeat) with the model-time figures of the
measured requests. Points collapse to the median of their repeats with the spread (min, max);
ratios between two targets are medians of the per-repeat ratios (both runs of a pair in the
same repeat, back to back). The peer is the Rust router whose targets ran: ``smg:POLICY`` (smg
1.13) or, in older results, ``sglang:POLICY`` (sglang-router 0.3.2); with both, smg unless
``--peer sglang``. Its best policy is the best of all of its policies that ran.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from report import PEER_NAMES, peer_prefix, saved_results  # the OAS report

MISS_SHARE = 0.9  # a router "meets the SLO" at a rate while >= 90 % of requests are within it
OURS = "omni:oas@kv-events"
METRICS = ("goodput_qpm", "slo_share", "p50_ttft_s", "p90_ttft_s", "p99_ttft_s",
           "cached_share", "p50_tpot_ms", "qpm")
START, END = "<!-- prefix-eval:start -->", "<!-- prefix-eval:end -->"


def _ok(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if "failed" not in r]


def collapse(rows: list[dict[str, Any]]) -> dict[tuple[str, str, float, str], dict[str, Any]]:
    """(cluster, workload, rate, target) -> median of each metric, its spread and repeats."""
    groups: dict[tuple[str, str, float, str], list[dict[str, Any]]] = {}
    for r in _ok(rows):
        groups.setdefault((r["cluster"], r["workload"], r["rate"], r["target"]), []).append(r)
    out = {}
    for key, group in groups.items():
        point: dict[str, Any] = {"repeats": len(group), "errors": sum(g["errors"] for g in group)}
        for name in METRICS:
            values = [g[name] for g in group if g.get(name) is not None]
            point[name] = statistics.median(values) if values else None
            point[f"{name}_spread"] = (min(values), max(values)) if values else None
        out[key] = point
    return out


def paired(rows: list[dict[str, Any]], cluster: str, workload: str, rate: float, target: str,
           peer: str, metric: str = "goodput_qpm") -> list[float]:
    """``target`` / ``peer`` per repeat at one point; infinite where only the peer has none
    (a peer with no request within the SLO is beaten by any positive goodput), skipped where
    neither has any."""
    by_repeat: dict[int, dict[str, float]] = {}
    for r in _ok(rows):
        if (r["cluster"], r["workload"], r["rate"]) == (cluster, workload, rate):
            by_repeat.setdefault(r["repeat"], {})[r["target"]] = r[metric]
    out = []
    for _, pair in sorted(by_repeat.items()):
        ours, theirs = pair.get(target), pair.get(peer)
        if ours is None or theirs is None or (not ours and not theirs):
            continue
        out.append(ours / theirs if theirs else math.inf)
    return out


def _ratio(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def criteria(rows: list[dict[str, Any]], cluster: str, workload: str, ours: str = OURS,
             peer: str | None = None) -> dict[str, Any]:
    """The issue's targets at the knee (the highest rate where the best policy of ``peer``, a
    target prefix, default the one that ran, keeps >= 90 % within the SLO) and at 1.5x the
    knee, if that rate was swept. ``best_sglang`` names the peer's best policy (either peer)."""
    points = collapse(rows)
    peer = peer or peer_prefix(rows)
    rates = sorted({k[2] for k in points if k[:2] == (cluster, workload)})
    present = list(dict.fromkeys(k[3] for k in points if k[:2] == (cluster, workload)
                                 and k[3].startswith(f"{peer}:")))
    if not rates or not present or not any((cluster, workload, r, ours) in points for r in rates):
        return {"cluster": cluster, "workload": workload, "peer": peer, "knee": None}

    def best_share(rate: float) -> float:
        return max(((points[(cluster, workload, rate, t)]["slo_share"] or 0.0)
                    for t in present if (cluster, workload, rate, t) in points), default=0.0)

    knee = max((r for r in rates if best_share(r) >= MISS_SHARE), default=None)
    out: dict[str, Any] = {"cluster": cluster, "workload": workload, "ours": ours, "peer": peer,
                           "knee": knee, "rates": rates, "points": []}
    if knee is None:
        return out
    for rate in (knee, knee * 1.5):
        match = [r for r in rates if abs(r - rate) <= 0.01 * rate]
        if not match:
            out["points"].append({"rate": rate, "swept": False})
            continue
        rate = match[0]
        here = {t: points.get((cluster, workload, rate, t)) for t in (ours, *present)}
        if here[ours] is None:
            out["points"].append({"rate": rate, "swept": False})
            continue
        best = max(present, key=lambda t: (here[t] or {}).get("goodput_qpm") or 0.0)
        rr = f"{peer}:round_robin" if here.get(f"{peer}:round_robin") else None
        ours_p90, best_p90 = here[ours]["p90_ttft_s"], here[best]["p90_ttft_s"]  # type: ignore[index]
        out["points"].append({
            "rate": rate, "swept": True, "best_sglang": best,
            "ours_goodput": here[ours]["goodput_qpm"],
            "best_goodput": here[best]["goodput_qpm"],  # type: ignore[index]
            "rr_goodput": here[rr]["goodput_qpm"] if rr else None,  # type: ignore[index]
            "vs_rr": _ratio(paired(rows, cluster, workload, rate, ours, rr)) if rr else None,
            "vs_rr_per_repeat": paired(rows, cluster, workload, rate, ours, rr) if rr else [],
            "vs_best": _ratio(paired(rows, cluster, workload, rate, ours, best)),
            "vs_best_per_repeat": paired(rows, cluster, workload, rate, ours, best),
            "ours_p90_ttft_s": ours_p90, "best_p90_ttft_s": best_p90,
            "p90_lower_by": (best_p90 / ours_p90) if ours_p90 and best_p90 else None})
    return out


def _fmt(x: float | None, digits: int = 0) -> str:
    if x is None:
        return "n/a"
    return "∞" if math.isinf(x) else f"{x:,.{digits}f}"


def criteria_text(crit: dict[str, Any]) -> str:
    head = f"**{crit['cluster']}, {crit['workload']}**"
    peer = crit.get("peer", "sglang")  # criteria from before smg name no peer: sglang-router
    them = PEER_NAMES.get(peer, peer)
    if crit.get("knee") is None:
        return f"{head}: no swept rate where a {them} policy kept >= 90 % within the SLO."
    lines = [f"{head}: knee = {_fmt(crit['knee'], 1)} req/s per caching worker (highest rate "
             f"where the best {them} policy keeps >= 90 % within the SLO); criteria for "
             f"{crit['ours']}.\n", "| rate | criterion | target | measured | met |",
             "|---|---|---|---|---|"]
    for p in crit["points"]:
        rate = _fmt(p["rate"], 1)
        if not p["swept"]:
            lines.append(f"| {rate} | (not swept) | | | |")
            continue
        per = {name: "" if len(p[name]) < 2 else
               " (" + ", ".join(_fmt(x, 2) for x in p[name]) + ")"
               for name in ("vs_rr_per_repeat", "vs_best_per_repeat")}
        lines.append(f"| {rate} | goodput / {peer} round_robin | >= 1.5x | {_fmt(p['vs_rr'], 2)}x "
                     f"({_fmt(p['ours_goodput'])} vs {_fmt(p['rr_goodput'])} QPM)"
                     f"{per['vs_rr_per_repeat']} | {'yes' if (p['vs_rr'] or 0) >= 1.5 else 'no'} |")
        above_knee = p is crit["points"][-1] and len(crit["points"]) > 1
        want = 1.5 if above_knee else 1.2  # goodput / the best peer policy
        lines.append(f"| {rate} | goodput / best {them} ({p['best_sglang']}) | >= {want:g}x | "
                     f"{_fmt(p['vs_best'], 2)}x ({_fmt(p['best_goodput'])} QPM)"
                     f"{per['vs_best_per_repeat']} | {'yes' if (p['vs_best'] or 0) >= want else 'no'} |")
        if above_knee:
            lines.append(f"| {rate} | P90 TTFT: {p['best_sglang']} / ours | >= 3x | "
                         f"{_fmt(p['p90_lower_by'], 2)}x ({_fmt(p['best_p90_ttft_s'], 2)} vs "
                         f"{_fmt(p['ours_p90_ttft_s'], 2)} s) | "
                         f"{'yes' if (p['p90_lower_by'] or 0) >= 3 else 'no'} |")
    return "\n".join(lines)


def _cell(point: dict[str, Any] | None) -> str:
    if point is None:
        return "–"
    good = _fmt(point["goodput_qpm"])
    spread = point.get("goodput_qpm_spread")
    if point["repeats"] > 1 and spread:
        good += f" ({_fmt(spread[0])}–{_fmt(spread[1])})"
    cached = "" if point["cached_share"] is None else f", {point['cached_share']:.0%} cached"
    return (f"{good} / {_fmt(point['p90_ttft_s'], 2)} s / {(point['slo_share'] or 0):.0%}"
            f"{cached}")


def tables(rows: list[dict[str, Any]]) -> str:
    points = collapse(rows)
    lines: list[str] = []
    for cluster, workload in dict.fromkeys((k[0], k[1]) for k in points):
        rates = sorted({k[2] for k in points if k[:2] == (cluster, workload)})
        targets = list(dict.fromkeys(k[3] for k in points if k[:2] == (cluster, workload)))
        repeats = max(p["repeats"] for k, p in points.items() if k[:2] == (cluster, workload))
        lines.append(f"**{cluster}, {workload}** — goodput QPM (min–max over {repeats} "
                     "repeats) / P90 TTFT / share within SLO, prompt tokens cached; rate = "
                     "model requests/s per caching worker:\n")
        lines.append("| router:policy | " + " | ".join(f"{_fmt(r, 1)}" for r in rates) + " |")
        lines.append("|---" * (len(rates) + 1) + "|")
        for t in targets:
            lines.append(f"| {t} | " + " | ".join(_cell(points.get((cluster, workload, r, t)))
                                                  for r in rates) + " |")
        lines.append("")
        lines.append(f"P50 / P90 / P99 TTFT (s), {cluster}, {workload}:\n")
        lines.append("| router:policy | " + " | ".join(f"{_fmt(r, 1)}" for r in rates) + " |")
        lines.append("|---" * (len(rates) + 1) + "|")
        for t in targets:
            cells = []
            for r in rates:
                p = points.get((cluster, workload, r, t))
                cells.append("–" if p is None else f"{_fmt(p['p50_ttft_s'], 2)} / "
                             f"{_fmt(p['p90_ttft_s'], 2)} / {_fmt(p['p99_ttft_s'], 2)}")
            lines.append(f"| {t} | " + " | ".join(cells) + " |")
        lines.append("")
    failed = [r for r in rows if "failed" in r]
    if failed:
        lines.append("Failed runs: " + "; ".join(
            f"{r['cluster']} {r['workload']} {r['rate']:g} {r['target']}" for r in failed) + "\n")
    return "\n".join(lines)


def plots(rows: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """One PNG per cluster: goodput and P50/P90/P99 TTFT against rate, one row per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = collapse(rows)
    written = []
    for cluster in dict.fromkeys(k[0] for k in points):
        workloads = list(dict.fromkeys(k[1] for k in points if k[0] == cluster))
        fig, axes = plt.subplots(len(workloads), 4, figsize=(20, 4 * len(workloads)),
                                 squeeze=False)
        for row, workload in zip(axes, workloads, strict=True):
            targets = dict.fromkeys(k[3] for k in points if k[:2] == (cluster, workload))
            for t in targets:
                pts = sorted((k[2], p) for k, p in points.items()
                             if k[:2] == (cluster, workload) and k[3] == t)
                style = "-" if t.startswith("omni") else "--"
                for ax, name in zip(row, ("goodput_qpm", "p50_ttft_s", "p90_ttft_s",
                                          "p99_ttft_s"), strict=True):
                    valid = [(r, p) for r, p in pts if p[name] is not None]
                    ax.errorbar([r for r, _ in valid], [p[name] for _, p in valid],
                                yerr=[[p[name] - p[f"{name}_spread"][0] for _, p in valid],
                                      [p[f"{name}_spread"][1] - p[name] for _, p in valid]],
                                marker="o", linestyle=style, label=t, capsize=3)
            for ax, title in zip(row, ("goodput (QPM within SLO)", "P50 TTFT (s)",
                                       "P90 TTFT (s)", "P99 TTFT (s)"), strict=True):
                ax.set_title(f"{cluster} {workload}: {title}")
                ax.set_xlabel("rate (model req/s per caching worker)")
                ax.grid(alpha=0.3)
                if "TTFT" in title:
                    ax.set_yscale("log")
            row[0].legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"prefix_{cluster}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def write_report(rows: list[dict[str, Any]], out_dir: Path, docs: Path | None = None,
                 peer: str | None = None) -> str:
    points = collapse(rows)
    crits = [criteria(rows, c, w, peer=peer) for c, w in dict.fromkeys((k[0], k[1])
                                                                        for k in points)]
    (out_dir / "criteria.json").write_text(json.dumps(crits, indent=1))
    if points:
        plots(rows, out_dir)
    text = "\n\n".join(criteria_text(c) for c in crits) + "\n\n" + tables(rows)
    (out_dir / "tables.md").write_text(text + "\n")
    if docs is not None:
        replace_block(docs, text)
    return text


def replace_block(docs: Path, body: str) -> None:
    """Replace the generated block between the prefix-eval markers (they must exist)."""
    text = docs.read_text()
    if START not in text or END not in text:
        raise ValueError(f"{docs} has no {START} ... {END} block")
    head, rest = text.split(START, 1)
    docs.write_text(f"{head}{START}\n{body}\n{END}{rest.split(END, 1)[1]}")


def main() -> int:
    args, data = saved_results("Rebuild the prefix evaluation's tables and plots")
    print(write_report(data["runs"], args.results.parent, args.docs, args.peer))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
