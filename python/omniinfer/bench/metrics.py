"""Summary figures of a benchmark run; key names follow sglang.benchmark.serving."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from omniinfer.bench.client import RequestResult

PERCENTILES = (50, 90, 99)


def _stats(name: str, values: Sequence[float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    arr = np.asarray(values, dtype=float) * 1000.0  # milliseconds, as sglang reports
    out[f"mean_{name}_ms"] = float(arr.mean()) if arr.size else None
    out[f"median_{name}_ms"] = float(np.percentile(arr, 50)) if arr.size else None
    for p in PERCENTILES[1:]:
        out[f"p{p}_{name}_ms"] = float(np.percentile(arr, p)) if arr.size else None
    return out


def summarize(
    results: Sequence[RequestResult],
    duration_s: float,
    slo_ttft_s: float = 2.0,
    slo_tpot_s: float = 0.050,
) -> dict[str, float | int | None]:
    """QPM, throughput, latency percentiles, SLO goodput and error counts of one run."""
    done = [r for r in results if r.ok]
    duration_s = max(duration_s, 1e-9)
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    good = [
        r
        for r in done
        if r.ttft is not None and r.ttft <= slo_ttft_s and (r.tpot is None or r.tpot <= slo_tpot_s)
    ]
    summary: dict[str, float | int | None] = {
        "duration": duration_s,
        "completed": len(done),
        "errors": len(results) - len(done),
        "rejected": sum(1 for r in results if r.status in (429, 503)),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration_s,
        "requests_per_minute": 60.0 * len(done) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "goodput_requests_per_minute": 60.0 * len(good) / duration_s,
        "slo_ttft_s": slo_ttft_s,
        "slo_tpot_s": slo_tpot_s,
    }
    reported = [r for r in done if r.cached_tokens is not None]
    # share of prompt tokens the server found in its prefix cache (None: it reports none)
    summary["cached_token_share"] = (
        sum(r.cached_tokens or 0 for r in reported) / max(1, sum(r.prompt_tokens for r in reported))
        if reported else None)
    summary.update(_stats("ttft", [r.ttft for r in done if r.ttft is not None]))
    summary.update(_stats("tpot", [r.tpot for r in done if r.tpot is not None]))
    summary.update(_stats("itl", [x for r in done for x in r.itl]))
    summary.update(_stats("e2e_latency", [r.e2e for r in done if r.e2e is not None]))
    return summary


def format_table(summary: dict[str, float | int | None], title: str = "Benchmark") -> str:
    """A fixed-width table of the headline figures."""

    def fmt(value: float | int | None, digits: int = 2) -> str:
        if value is None:
            return "n/a"
        if isinstance(value, int):
            return str(value)
        return f"{value:.{digits}f}"

    rows = [
        ("Completed / errors", f"{summary['completed']} / {summary['errors']}"),
        ("Duration (s)", fmt(summary["duration"])),
        ("Requests per minute (QPM)", fmt(summary["requests_per_minute"])),
        ("Output tokens/s (OTT)", fmt(summary["output_throughput"])),
        ("Total tokens/s (TTT)", fmt(summary["total_token_throughput"])),
        ("Mean / P99 TTFT (ms)", f"{fmt(summary['mean_ttft_ms'], 1)} / {fmt(summary['p99_ttft_ms'], 1)}"),
        ("Mean / P99 TPOT (ms)", f"{fmt(summary['mean_tpot_ms'], 1)} / {fmt(summary['p99_tpot_ms'], 1)}"),
        ("Mean E2E latency (ms)", fmt(summary["mean_e2e_latency_ms"], 1)),
        (f"Goodput, TTFT < {summary.get('slo_ttft_s', 2.0):g} s & TPOT < "
         f"{1000 * float(summary.get('slo_tpot_s') or 0.05):g} ms (QPM)",
         fmt(summary["goodput_requests_per_minute"])),
    ]
    if summary.get("cached_token_share") is not None:
        rows.append(("Prompt tokens from cache", f"{summary['cached_token_share']:.1%}"))
    width = max(len(k) for k, _ in rows) + 2
    line = "=" * (width + 16)
    body = "\n".join(f"{k:<{width}}{v:>16}" for k, v in rows)
    return f"{line}\n{title:^{width + 16}}\n{line}\n{body}\n{line}"
