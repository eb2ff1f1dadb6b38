"""Tables, criteria and plots of ``oas_eval.py`` results (also runnable on a saved results.json).

    python benchmark/proxy/report.py benchmark/results/proxy/results.json [--docs docs/benchmarks.md]

The peer (the Rust router the criteria compare against) is the one whose targets the results
hold: ``smg:POLICY`` (smg 1.13, the default since) or ``sglang:POLICY`` (sglang-router 0.3.2,
older results); with both, smg (``--peer sglang`` picks the other). "Best peer" is the best of
all of the peer's policies that ran.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

SECTION = "## OmniProxy OAS evaluation"
MISS_SHARE = 0.9  # a policy "misses the SLO" when fewer than 90 % of requests meet it
PEER_PREFIXES = ("smg", "sglang")  # target prefixes of smg 1.13 and of sglang-router 0.3.2
PEER_NAMES = {"smg": "smg", "sglang": "sglang-router"}
OMNI_RANKED = ("omni:oas", "omni:omni_default", "omni:omni_earliest_batch")


def _ok(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if "summary" in r]


def peer_prefix(rows: list[dict[str, Any]]) -> str:
    """The peer the rows compare against: ``smg`` when any smg target ran, else ``sglang``."""
    ran = {str(r.get("target", "")).split(":", 1)[0] for r in rows}
    return next((p for p in PEER_PREFIXES if p in ran), PEER_PREFIXES[-1])


def peer_targets(rows: list[dict[str, Any]], peer: str) -> list[str]:
    """Every target of ``peer`` (a prefix) that ran, in order of appearance."""
    return list(dict.fromkeys(r["target"] for r in _ok(rows)
                              if r["target"].startswith(f"{peer}:")))


MEDIAN_KEYS = ("goodput_requests_per_minute", "requests_per_minute", "p99_ttft_ms",
               "median_ttft_ms", "median_tpot_ms")


def _key(r: dict[str, Any]) -> tuple[str, str, str, int]:
    return r["cluster"], r["workload"], r["target"], r["concurrency"]


def _median(values: list[float]) -> float | None:
    values = sorted(values)
    if not values:
        return None
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def _sum_tallies(tallies: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """Add up the routers' prediction counters (per cache truth) over repeats."""
    out: dict[str, dict[str, float]] = {}
    for tally in tallies:
        for truth, counts in (tally or {}).items():
            if isinstance(counts, dict):
                slot = out.setdefault(truth, {})
                for name, v in counts.items():
                    if isinstance(v, int | float):
                        slot[name] = slot.get(name, 0) + v
    return out or None


def collapse(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (cluster, workload, target, concurrency) with the median of its repeats.

    A repeated point keeps the median of each headline metric, the spread (min, max) of
    goodput and P99 TTFT, every repeat's goodput in ``per_repeat``, pooled TTFTs (for the CDF)
    and summed errors and prediction counters. A single run passes through unchanged.
    """
    groups: dict[tuple[str, str, str, int], list[dict[str, Any]]] = {}
    for r in _ok(rows):
        groups.setdefault(_key(r), []).append(r)
    out = []
    for group in groups.values():
        row = {**group[0], "repeats": len(group)}
        if len(group) > 1:
            summary = dict(group[0]["summary"])
            for name in MEDIAN_KEYS:
                summary[name] = _median([g["summary"][name] for g in group
                                         if g["summary"].get(name) is not None])
            summary["errors"] = sum(g["summary"].get("errors", 0) for g in group)
            row["summary"] = summary
            row["slo_share"] = _median([g["slo_share"] for g in group])
            row["ttfts"] = [t for g in group for t in g["ttfts"]]
            goodputs = [g["summary"]["goodput_requests_per_minute"] for g in group]
            p99s = [g["summary"]["p99_ttft_ms"] or 0.0 for g in group]
            row["per_repeat"] = goodputs
            row["spread"] = {"goodput": (min(goodputs), max(goodputs)),
                             "p99_ttft_ms": (min(p99s), max(p99s))}
            row["cache_prediction"] = _sum_tallies([g.get("cache_prediction") for g in group])
        out.append(row)
    return out


def paired_ratios(rows: list[dict[str, Any]], cluster: str, workload: str, conc: int | None,
                  target: str, peer: str, metric: str = "goodput_requests_per_minute"
                  ) -> list[float]:
    """``target``/``peer`` per repeat, each pair measured back to back in the same repeat."""
    by_repeat: dict[int, dict[str, float]] = {}
    for r in _ok(rows):
        if (r["cluster"], r["workload"]) == (cluster, workload) and (
                conc is None or r["concurrency"] == conc) and r["target"] in (target, peer):
            by_repeat.setdefault(r.get("repeat", 0), {})[r["target"]] = r["summary"][metric]
    return [pair[target] / pair[peer] for _, pair in sorted(by_repeat.items())
            if target in pair and peer in pair and pair[peer]]


def _get(rows: list[dict[str, Any]], cluster: str, workload: str, target: str,
         concurrency: int | None = None) -> dict[str, Any] | None:
    for r in _ok(rows):
        if (r["cluster"], r["workload"], r["target"]) == (cluster, workload, target) and (
                concurrency is None or r["concurrency"] == concurrency):
            return r
    return None


def _fmt(x: float | None, digits: int = 0) -> str:
    return "n/a" if x is None else f"{x:,.{digits}f}"


def critical_concurrency(rows: list[dict[str, Any]], cluster: str, peer: str | None = None
                         ) -> int | None:
    """The lowest swept concurrency where the peer's round_robin first misses the SLO."""
    rr = f"{peer or peer_prefix(rows)}:round_robin"
    points = sorted((r["concurrency"], r["slo_share"]) for r in _ok(rows)
                    if r["cluster"] == cluster and r["workload"] == "paper"
                    and r["target"] == rr)
    for c, share in points:
        if share < MISS_SHARE:
            return c
    return points[-1][0] if points else None


OAS_VARIANTS = ("omni:oas_goodput",)  # judged against the same criteria as omni:oas


def criteria(raw: list[dict[str, Any]], cluster: str = "4P1D", ours: str = "omni:oas",
             peer: str | None = None) -> dict[str, Any]:
    """The issue's targets for ``ours`` against ``peer`` (a target prefix, ``smg`` or
    ``sglang``; default: the one that ran), on the medians of the repeats; goodput ratios are
    the median of the per-repeat paired ratios (ours and the peer's run back to back), with
    every ratio kept. ``best_sglang`` names the peer's best policy (whichever peer)."""
    rows = collapse(raw)
    peer = peer or peer_prefix(raw)
    names = peer_targets(rows, peer)
    out: dict[str, Any] = {"cluster": cluster, "ours": ours, "peer": peer}
    c = critical_concurrency(rows, cluster, peer)
    out["critical_concurrency"] = c
    for workload, conc in (("paper", c), ("mooncake", 0)):
        oas = _get(rows, cluster, workload, ours, conc)
        rr = _get(rows, cluster, workload, f"{peer}:round_robin", conc)
        peers = [r for r in (_get(rows, cluster, workload, t, conc) for t in names) if r]
        if not oas or not rr or not peers:
            continue
        best = max(peers, key=lambda r: r["summary"]["goodput_requests_per_minute"])
        g = lambda r: r["summary"]["goodput_requests_per_minute"]  # noqa: E731
        pairs_rr = paired_ratios(raw, cluster, workload, conc, ours, rr["target"])
        pairs_best = paired_ratios(raw, cluster, workload, conc, ours, best["target"])
        out[workload] = {
            "oas_goodput": g(oas), "rr_goodput": g(rr), "best_sglang": best["target"],
            "best_goodput": g(best), "repeats": oas.get("repeats", 1),
            "vs_rr": _median(pairs_rr) if pairs_rr else (g(oas) / g(rr) if g(rr) else None),
            "vs_best": (_median(pairs_best) if pairs_best
                        else (g(oas) / g(best) if g(best) else None)),
            "vs_rr_per_repeat": pairs_rr, "vs_best_per_repeat": pairs_best,
            "oas_p99_ttft_ms": oas["summary"]["p99_ttft_ms"],
            "best_p99_ttft_ms": best["summary"]["p99_ttft_ms"],
            "p99_change": (oas["summary"]["p99_ttft_ms"] / best["summary"]["p99_ttft_ms"] - 1
                           if best["summary"]["p99_ttft_ms"] else None),
            "qpm_ratio": (oas["summary"]["requests_per_minute"]
                          / best["summary"]["requests_per_minute"]),
            "ranking": [r["target"] for r in sorted(
                [x for x in _ok(rows) if x["cluster"] == cluster and x["workload"] == workload
                 and x["concurrency"] == conc and (x["target"] in (ours, *OMNI_RANKED, *names))],
                key=lambda r: -g(r))],
        }
    open_rows = {t: _get(rows, cluster, "paper-open", t, 0)
                 for t in (ours, *names)}
    oas_open = open_rows.pop(ours)
    peers_open = [r for r in open_rows.values() if r and r["summary"]["p99_ttft_ms"]]
    if oas_open and peers_open:
        lowest = min(peers_open, key=lambda r: r["summary"]["p99_ttft_ms"])
        out["paper_open"] = {
            "qpm": oas_open.get("qpm"), "best_sglang": lowest["target"],
            "oas_p99_ttft_ms": oas_open["summary"]["p99_ttft_ms"],
            "best_p99_ttft_ms": lowest["summary"]["p99_ttft_ms"],
            "p99_change": oas_open["summary"]["p99_ttft_ms"] / lowest["summary"]["p99_ttft_ms"] - 1,
            "qpm_ratio": (oas_open["summary"]["requests_per_minute"]
                          / lowest["summary"]["requests_per_minute"]),
            "oas_goodput": oas_open["summary"]["goodput_requests_per_minute"],
            "best_goodput": max(r["summary"]["goodput_requests_per_minute"] for r in peers_open),
        }
    return out


def plots(rows: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    clusters = sorted({r["cluster"] for r in _ok(rows)})
    main = [t for t in dict.fromkeys(r["target"] for r in _ok(rows))
            if not t.split(":")[1].startswith("oas_")]
    fig, axes = plt.subplots(1, len(clusters), figsize=(6 * len(clusters), 4), squeeze=False)
    for ax, cluster in zip(axes[0], clusters, strict=True):
        for t in main:
            pts = sorted((r["concurrency"], r["summary"]["goodput_requests_per_minute"])
                         for r in _ok(rows) if r["cluster"] == cluster and r["target"] == t
                         and r["workload"] == "paper")
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=t,
                        linestyle="-" if t.startswith("omni") else "--")
        ax.set_title(f"{cluster}: paper workload, goodput (TTFT<2 s, TPOT<50 ms)")
        ax.set_xlabel("concurrency")
        ax.set_ylabel("goodput (requests/min, model time)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    goodput = out_dir / "goodput.png"
    fig.savefig(goodput, dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    big = clusters[-1]
    c = critical_concurrency(rows, big)
    for ax, (workload, conc) in zip(axes, (("paper", c), ("mooncake", 0)), strict=True):
        for t in main:
            r = _get(rows, big, workload, t, conc)
            if r and r["ttfts"]:
                x = np.sort(np.asarray(r["ttfts"]))
                ax.plot(x, np.arange(1, len(x) + 1) / len(x), label=t,
                        linestyle="-" if t.startswith("omni") else "--")
        ax.axvline(2.0, color="grey", linewidth=0.8)
        title = f"c={conc}" if workload == "paper" else "open loop"
        ax.set_title(f"{big} {workload} ({title}): TTFT CDF")
        ax.set_xlabel("TTFT (s, model time)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    cdf = out_dir / "ttft_cdf.png"
    fig.savefig(cdf, dpi=110)
    plt.close(fig)
    return [goodput, cdf]


def _prediction_cell(row: dict[str, Any]) -> str:
    """The router's own counters: share of exact / over / under predictions (whole blocks)."""
    tally = (row.get("cache_prediction") or {}).get(row.get("cache_truth", "router"))
    measured = tally.get("measured") if tally else None
    if not measured:
        return "–"
    return (f"{tally['exact'] / measured:.0%} / {tally['over'] / measured:.0%} / "
            f"{tally['under'] / measured:.0%} (n={measured})")


def _goodput_cell(r: dict[str, Any]) -> str:
    """Median goodput (min–max over repeats when repeated)."""
    text = _fmt(r["summary"]["goodput_requests_per_minute"])
    if r.get("repeats", 1) > 1:
        low, high = r["spread"]["goodput"]
        text += f" ({_fmt(low)}–{_fmt(high)})"
    return text


def _open_table(rows: list[dict[str, Any]], cluster: str, workload: str, title: str
                ) -> list[str]:
    chosen = [r for r in _ok(rows) if r["cluster"] == cluster and r["workload"] == workload]
    if not chosen:
        return []
    qpm = chosen[0].get("qpm")
    lines = [f"**{cluster}, {title}" + (f" at {qpm:,.0f} QPM" if qpm else "") + ":**\n",
             "| router:policy | QPM | goodput QPM | TTFT p50 / p99 (s) | TPOT p50 (ms) "
             "| errors | predicted cache = reported (hits) | cache prediction exact / "
             "over / under |",
             "|---|---|---|---|---|---|---|---|"]
    for r in chosen:
        s = r["summary"]
        pred = r.get("prediction")
        ptxt = ("–" if not pred else f"{pred['within_one_block']:.0%} "
                f"({pred['hit_within_one_block']:.0%} of {pred['hit_requests']})")
        lines.append(f"| {r['target']} | {_fmt(s['requests_per_minute'])} | "
                     f"{_goodput_cell(r)} | "
                     f"{_fmt((s['median_ttft_ms'] or 0) / 1000, 2)} / "
                     f"{_fmt((s['p99_ttft_ms'] or 0) / 1000, 2)} | "
                     f"{_fmt(s['median_tpot_ms'], 1)} | {s['errors']} | {ptxt} | "
                     f"{_prediction_cell(r)} |")
    lines.append("")
    return lines


def tables(raw: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines: list[str] = []
    rows = [*collapse(raw), *(r for r in raw if "failed" in r)]
    repeats = max((r.get("repeats", 1) for r in _ok(rows)), default=1)
    if repeats > 1:
        lines.append(f"Each point is the median of {repeats} repeats (run interleaved); "
                     "goodput's range over the repeats is in parentheses.\n")
    for cluster in sorted({r["cluster"] for r in rows}):
        concs = sorted({r["concurrency"] for r in _ok(rows)
                        if r["cluster"] == cluster and r["workload"] == "paper"})
        targets = list(dict.fromkeys(r["target"] for r in _ok(rows) if r["cluster"] == cluster
                                     and r["workload"] == "paper"
                                     and not r["target"].split(":")[1].startswith("oas_")))
        lines.append(f"**{cluster}, paper workload, closed loop** — goodput QPM / P99 TTFT s "
                     f"(share of requests within SLO):\n")
        lines.append("| router:policy | " + " | ".join(f"c={c}" for c in concs) + " |")
        lines.append("|---" * (len(concs) + 1) + "|")
        for t in targets:
            cells = []
            for c in concs:
                r = _get(rows, cluster, "paper", t, c)
                cells.append("–" if r is None else
                             f"{_goodput_cell(r)} / "
                             f"{_fmt((r['summary']['p99_ttft_ms'] or 0) / 1000, 2)} "
                             f"({r['slo_share']:.0%})")
            lines.append(f"| {t} | " + " | ".join(cells) + " |")
        lines.append("")
        for workload, title in (("paper-open", "paper workload, open loop (Poisson)"),
                                ("mooncake", "Mooncake trace, open loop")):
            lines.extend(_open_table(rows, cluster, workload, title))
    failed = [r for r in rows if "failed" in r]
    if failed:
        lines.append("Failed runs: " + "; ".join(f"{r['cluster']} {r['target']} {r['workload']}"
                                                  for r in failed) + "\n")
    abl = [r for r in _ok(rows) if r["cluster"] == "4P1D" and (
        r["target"].split(":")[1].startswith("oas"))]
    if any(r["target"] != "omni:oas" for r in abl):
        c = meta.get("ablation_concurrency")
        lines.append(f"**Ablation, 4P1D** (paper at c={c}; Mooncake open loop):\n")
        lines.append("| variant | paper goodput QPM | paper P99 TTFT (s) | Mooncake goodput QPM "
                     "| Mooncake P99 TTFT (s) |")
        lines.append("|---|---|---|---|---|")
        for t in dict.fromkeys(r["target"] for r in abl):
            p = _get(rows, "4P1D", "paper", t, c)
            m = _get(rows, "4P1D", "mooncake", t, 0)
            lines.append(
                f"| {t} | {_goodput_cell(p) if p else 'n/a'} | "
                f"{_fmt(p and (p['summary']['p99_ttft_ms'] or 0) / 1000, 2)} | "
                f"{_fmt(m and m['summary']['goodput_requests_per_minute'])} | "
                f"{_fmt(m and (m['summary']['p99_ttft_ms'] or 0) / 1000, 2)} |")
        lines.append("")
    return "\n".join(lines)


def _per_repeat(crit: dict[str, Any], name: str) -> str:
    ratios = crit.get(name) or []
    if len(ratios) < 2:
        return ""
    return "; per repeat " + ", ".join(f"{x:.2f}" for x in ratios)


def criteria_text(crit: dict[str, Any]) -> str:
    ours = crit.get("ours", "omni:oas")
    peer = crit.get("peer", "sglang")  # criteria from before smg name no peer: sglang-router
    them = PEER_NAMES.get(peer, peer)
    name = "OAS" if ours == "omni:oas" else f"`{ours.split(':', 1)[1]}`"
    lines = [f"Critical concurrency on {crit['cluster']} ({them} round_robin first below "
             f"{MISS_SHARE:.0%} within SLO): c={crit['critical_concurrency']}; criteria for "
             f"{ours}.\n",
             "| criterion | target | measured | met |", "|---|---|---|---|"]
    p = crit.get("paper")
    if p:
        lines.append(f"| paper: {name} goodput / {peer} round_robin | ≥ 1.5× | "
                     f"{_fmt(p['vs_rr'], 2)}× ({_fmt(p['oas_goodput'])} vs "
                     f"{_fmt(p['rr_goodput'])} QPM){_per_repeat(p, 'vs_rr_per_repeat')} | "
                     f"{'yes' if (p['vs_rr'] or 0) >= 1.5 else 'no'} |")
        lines.append(f"| paper: {name} goodput / best {them} ({p['best_sglang']}) | ≥ 1.2× | "
                     f"{_fmt(p['vs_best'], 2)}×{_per_repeat(p, 'vs_best_per_repeat')} | "
                     f"{'yes' if (p['vs_best'] or 0) >= 1.2 else 'no'} |")
        lines.append(f"| paper: {name} P99 TTFT vs best {them} (QPM ratio "
                     f"{p['qpm_ratio']:.2f}) | ≤ −38 % | {(p['p99_change'] or 0):+.0%} "
                     f"({_fmt(p['oas_p99_ttft_ms'] / 1000, 2)} vs "
                     f"{_fmt(p['best_p99_ttft_ms'] / 1000, 2)} s) | "
                     f"{'yes' if (p['p99_change'] or 0) <= -0.38 else 'no'} |")
    o = crit.get("paper_open")
    if o:
        lines.append(f"| paper, open loop at {_fmt(o['qpm'])} QPM: {name} P99 TTFT vs the lowest "
                     f"{them} P99 ({o['best_sglang']}; QPM ratio {o['qpm_ratio']:.2f}) "
                     f"| ≤ −38 % | {o['p99_change']:+.0%} ({_fmt(o['oas_p99_ttft_ms'] / 1000, 2)} "
                     f"vs {_fmt(o['best_p99_ttft_ms'] / 1000, 2)} s) | "
                     f"{'yes' if o['p99_change'] <= -0.38 else 'no'} |")
    m = crit.get("mooncake")
    if m:
        same = (m["vs_rr"] or 0) >= 1.0 and (m["vs_best"] or 0) >= 1.0
        lines.append(f"| Mooncake: same ranking ({name} ≥ every {them} policy) | {name} first "
                     f"| order {' > '.join(t for t in m['ranking'])}; {name}/best "
                     f"{_fmt(m['vs_best'], 2)}×, P99 {(m['p99_change'] or 0):+.0%} | "
                     f"{'yes' if same else 'no'} |")
    return "\n".join(lines)


def write_report(rows: list[dict[str, Any]], meta: dict[str, Any], out_dir: Path,
                 docs: Path | None, peer: str | None = None) -> str:
    out_dir = Path(out_dir)
    crit = criteria(rows, peer=peer)
    variants = [criteria(rows, ours=t, peer=peer) for t in OAS_VARIANTS
                if any(r["target"] == t for r in _ok(rows))]
    (out_dir / "criteria.json").write_text(json.dumps({**crit, "variants": variants}, indent=1))
    if _ok(rows):
        plots(collapse(rows), out_dir)
    text = "\n\n".join(criteria_text(c) for c in (crit, *variants)) + "\n\n" + tables(rows, meta)
    (out_dir / "tables.md").write_text(text + "\n")
    if docs is not None:
        replace_section(Path(docs), text)
    return text


def replace_section(docs: Path, body: str) -> None:
    """Replace the OAS section's generated block (between markers) or append the section."""
    start, end = "<!-- oas-eval:start -->", "<!-- oas-eval:end -->"
    text = docs.read_text()
    block = f"{start}\n{body}\n{end}"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        text = head + block + rest.split(end, 1)[1]
    elif SECTION in text:
        text = text.rstrip() + "\n\n" + block + "\n"
    else:
        text = text.rstrip() + f"\n\n{SECTION}\n\n{block}\n"
    docs.write_text(text)


def saved_results(description: str) -> tuple[argparse.Namespace, dict[str, Any]]:
    """The command line of a report rebuilt from a saved results.json (the file, ``--docs``,
    ``--peer``: a prefix of ``PEER_PREFIXES`` or None), and that file's content."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("results", type=Path)
    p.add_argument("--docs", type=Path, default=None)
    p.add_argument("--peer", choices=PEER_PREFIXES, default=None,
                   help="the peer's target prefix (default: smg if it ran, else sglang)")
    args = p.parse_args()
    return args, json.loads(args.results.read_text())


def main() -> int:
    args, data = saved_results("Rebuild the OAS tables and plots")
    print(write_report(data["runs"], data["meta"], args.results.parent, args.docs, args.peer))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
