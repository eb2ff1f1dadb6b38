"""Run rows of the proxy benchmarks' results, for the reports' tests."""

from __future__ import annotations

from typing import Any


def prefix_row(target: str, rate: float, repeat: int, goodput: float, share: float, p90: float,
               cluster: str = "8R") -> dict[str, Any]:
    """A prefix_eval.py run row of ``target`` on prefix-groups: goodput as its qpm too, the TTFT
    percentiles p90 / 2, p90, 2 x p90, half the prompt tokens cached, no errors."""
    return {"cluster": cluster, "workload": "prefix-groups", "rate": rate, "target": target,
            "repeat": repeat, "goodput_qpm": goodput, "slo_share": share, "errors": 0,
            "p50_ttft_s": p90 / 2, "p90_ttft_s": p90, "p99_ttft_s": p90 * 2, "qpm": goodput,
            "cached_share": 0.5, "p50_tpot_ms": 20.0}
