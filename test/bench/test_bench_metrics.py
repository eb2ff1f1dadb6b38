"""Benchmark summary arithmetic on hand-made results."""

from __future__ import annotations

import pytest

from omniinfer.bench.client import RequestResult
from omniinfer.bench.metrics import format_table, summarize


def result(i: int, ttft: float, e2e: float, out: int, error: str | None = None) -> RequestResult:
    r = RequestResult(i, prompt_tokens=100, requested_output_tokens=out, output_tokens=out,
                      ttft=ttft, e2e=e2e, error=error)
    r.itl = [(e2e - ttft) / max(out - 1, 1)] * (out - 1)
    return r


def test_summary_figures() -> None:
    results = [result(0, 0.5, 2.5, 41), result(1, 3.0, 4.0, 11), result(2, 1.0, 1.0, 1, error="boom")]
    s = summarize(results, duration_s=30.0, slo_ttft_s=2.0, slo_tpot_s=0.06)
    assert s["completed"] == 2 and s["errors"] == 1
    assert s["requests_per_minute"] == pytest.approx(4.0)
    assert s["output_throughput"] == pytest.approx(52 / 30)
    assert s["total_token_throughput"] == pytest.approx(252 / 30)
    assert s["mean_ttft_ms"] == pytest.approx(1750.0)
    assert s["mean_tpot_ms"] == pytest.approx((50.0 + 100.0) / 2)
    # Request 0 meets both SLOs; request 1 misses TTFT.
    assert s["goodput_requests_per_minute"] == pytest.approx(2.0)
    table = format_table(s, "t")
    assert "Requests per minute (QPM)" in table and "4.00" in table


def test_empty_run_has_no_percentiles() -> None:
    s = summarize([], duration_s=1.0)
    assert s["completed"] == 0 and s["mean_ttft_ms"] is None
    assert "n/a" in format_table(s)
