"""SLO capacity from a rate sweep, pure: no I/O, no processes (``capacity.py`` runs the sweep).

``capacity_at(points, share)``: the offered rate at which the share of requests within the SLO
falls below ``share``, linearly interpolated between the last point at or above it and the first
point below it. Points need not be monotone (noise): the first crossing counts. Where even the
lowest rate is below, the capacity is that rate with ``bound`` "<"; where no rate is below, the
highest rate with ``bound`` ">=" (a lower bound: the sweep stopped first).

``summarize_capacity(rows)`` groups a sweep's runs by (cluster, workload) and target and gives
each target's capacity at 90 % and 99 % per repeat, their median and range, its errors, and the
verdict lines: OAS against the best smg policy per repeat (by 90 % capacity) and the P99 TTFT
of both at that policy's capacity rate.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

OURS = "omni:oas"


def capacity_at(points: Sequence[tuple[float, float]], share: float) -> tuple[float, str]:
    """(rate, bound) where the SLO share first falls below ``share``; bound "", "<" or ">="."""
    pts = sorted(points)
    if not pts:
        raise ValueError("no points")
    if pts[0][1] < share:
        return pts[0][0], "<"
    for (r0, s0), (r1, s1) in zip(pts, pts[1:], strict=False):
        if s1 < share:
            frac = (s0 - share) / (s0 - s1) if s0 != s1 else 0.0
            return r0 + frac * (r1 - r0), ""
    return pts[-1][0], ">="


def value_at(points: Sequence[tuple[float, float]], rate: float) -> float | None:
    """``points`` (rate, value) linearly interpolated at ``rate``; None outside their range."""
    pts = sorted(points)
    for (r0, v0), (r1, v1) in zip(pts, pts[1:], strict=False):
        if r0 <= rate <= r1:
            return v0 if r1 == r0 else v0 + (rate - r0) / (r1 - r0) * (v1 - v0)
    if pts and abs(pts[-1][0] - rate) < 1e-9:
        return pts[-1][1]
    return None


def _text(values: list[tuple[float, str]]) -> str:
    caps = [v for v, _ in values]
    bounds = {b for _, b in values if b}
    mid = statistics.median(caps)
    spread = f" ({min(caps):,.0f}–{max(caps):,.0f})" if len(caps) > 1 else ""
    return ("".join(sorted(bounds)) + " " if bounds else "") + f"{mid:,.0f}{spread}"


def _errors(row: dict[str, Any]) -> int:
    if "failed" in row:
        return 1
    return int((row.get("summary") or {}).get("errors") or 0)


def summarize_capacity(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in sorted({(r["cluster"], r["workload"]) for r in rows}):
        mine = [r for r in rows if (r["cluster"], r["workload"]) == key]
        repeats = sorted({r["repeat"] for r in mine})
        per: dict[str, dict[int, dict[str, Any]]] = {}
        for name in sorted({r["target"] for r in mine}):
            for rep in repeats:
                runs = [r for r in mine if r["target"] == name and r["repeat"] == rep]
                if not runs:
                    continue
                shares = [(r["qpm"], r["slo_share"]) for r in runs]
                p99 = [(r["qpm"], (r.get("summary") or {}).get("p99_ttft_ms"))
                       for r in runs if (r.get("summary") or {}).get("p99_ttft_ms") is not None]
                per.setdefault(name, {})[rep] = {
                    "cap90": capacity_at(shares, 0.9), "cap99": capacity_at(shares, 0.99),
                    "p99": p99, "errors": sum(_errors(r) for r in runs)}
        targets = {}
        for name, reps in per.items():
            c90 = [v["cap90"] for v in reps.values()]
            c99 = [v["cap99"] for v in reps.values()]
            targets[name] = {"cap90": statistics.median(v for v, _ in c90),
                             "cap99": statistics.median(v for v, _ in c99),
                             "cap90_per_repeat": c90, "cap99_per_repeat": c99,
                             "cap90_text": _text(c90), "cap99_text": _text(c99),
                             "errors": sum(v["errors"] for v in reps.values())}
        out[f"{key[1]} on {key[0]}"] = {"targets": targets, **_verdict(per, repeats)}
    return out


def _verdict(per: dict[str, dict[int, dict[str, Any]]], repeats: list[int]) -> dict[str, Any]:
    peers = [n for n in per if n.startswith("smg:")]
    if OURS not in per or not peers:
        return {"verdict": [], "ratios": [], "p99_ratios": []}
    ratios, p99_ratios, lines = [], [], []
    for rep in repeats:
        if rep not in per[OURS]:
            continue
        best = max((n for n in peers if rep in per[n]), key=lambda n: per[n][rep]["cap90"][0])
        peer_cap = per[best][rep]["cap90"][0]
        ours = per[OURS][rep]["cap90"][0]
        ratio = ours / peer_cap if peer_cap > 0 else float("inf")
        ratios.append(ratio)
        peer_p99 = value_at(per[best][rep]["p99"], peer_cap)
        our_p99 = value_at(per[OURS][rep]["p99"], peer_cap)
        p99_ratio = (our_p99 / peer_p99) if peer_p99 and our_p99 is not None else None
        p99_ratios.append(p99_ratio)
        lines.append(f"repeat {rep}: best smg {best} {peer_cap:,.0f} QPM; oas {ours:,.0f} "
                     f"({ratio:.2f}x); P99 TTFT at {peer_cap:,.0f} QPM: oas "
                     f"{'-' if our_p99 is None else f'{our_p99:,.0f}'} ms vs "
                     f"{'-' if peer_p99 is None else f'{peer_p99:,.0f}'} ms"
                     + ("" if p99_ratio is None else f" ({p99_ratio:.2f}x)"))
    if ratios:
        lines.append(f"median oas / best smg at 90 %: {statistics.median(ratios):.2f}x")
    return {"verdict": lines, "ratios": ratios, "p99_ratios": p99_ratios}


def markdown(summary: dict[str, Any]) -> str:
    """One table per (workload, cluster): each target's capacity at 90 % and 99 % (median of the
    repeats, range in parentheses, ">=" a lower bound, "<" below the lowest rate) and its
    errors, best first; then the verdict lines."""
    out = []
    for key, panel in summary.items():
        out += [f"**{key}** (offered requests per model minute)", "",
                "| router:policy | 90 % SLO capacity | 99 % SLO capacity | errors |",
                "|---|---|---|---|"]
        ranked = sorted(panel["targets"].items(), key=lambda kv: -kv[1]["cap90"])
        out += [f"| {name} | {cap['cap90_text']} | {cap['cap99_text']} | {cap['errors']} |"
                for name, cap in ranked]
        out += [""] + [f"- {line}" for line in panel["verdict"]] + [""]
    return "\n".join(out)
