"""The OAS evaluation report: repeats collapse to medians, ratios are paired per repeat."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark" / "proxy"))

import report  # noqa: E402


def _row(target: str, repeat: int, goodput: float, p99_ms: float, share: float,
         conc: int = 96) -> dict[str, Any]:
    return {"cluster": "4P1D", "workload": "paper", "target": target, "concurrency": conc,
            "repeat": repeat, "slo_share": share, "ttfts": [p99_ms / 1000],
            "summary": {"goodput_requests_per_minute": goodput, "requests_per_minute": 1000.0,
                        "p99_ttft_ms": p99_ms, "median_ttft_ms": p99_ms / 2,
                        "median_tpot_ms": 10.0, "errors": repeat}}


RUNS = [
    # repeat 0 is disturbed for everyone (both halved): paired ratios ignore that
    _row("omni:oas", 0, 300.0, 4000.0, 0.5), _row("sglang:round_robin", 0, 200.0, 5000.0, 0.4),
    _row("sglang:cache_aware", 0, 150.0, 6000.0, 0.3),
    _row("omni:oas", 1, 900.0, 2000.0, 0.8), _row("sglang:round_robin", 1, 450.0, 3000.0, 0.6),
    _row("sglang:cache_aware", 1, 600.0, 2500.0, 0.7),
    _row("omni:oas", 2, 800.0, 2500.0, 0.7), _row("sglang:round_robin", 2, 500.0, 3500.0, 0.7),
    _row("sglang:cache_aware", 2, 700.0, 3000.0, 0.75),
]


def test_repeats_collapse_to_medians_with_spread() -> None:
    rows = {r["target"]: r for r in report.collapse(RUNS)}
    oas = rows["omni:oas"]
    assert oas["repeats"] == 3
    assert oas["summary"]["goodput_requests_per_minute"] == 800.0
    assert oas["summary"]["p99_ttft_ms"] == 2500.0
    assert oas["spread"]["goodput"] == (300.0, 900.0)
    assert oas["per_repeat"] == [300.0, 900.0, 800.0]
    assert oas["summary"]["errors"] == 0 + 1 + 2
    assert len(oas["ttfts"]) == 3
    assert rows["sglang:round_robin"]["slo_share"] == 0.6


def test_criteria_use_the_median_paired_ratio() -> None:
    crit = report.criteria(RUNS)
    assert crit["critical_concurrency"] == 96
    paper = crit["paper"]
    assert paper["vs_rr_per_repeat"] == [1.5, 2.0, 1.6]
    assert paper["vs_rr"] == 1.6  # not 800 / 450 (the ratio of medians)
    assert paper["best_sglang"] == "sglang:cache_aware"  # the best median goodput
    assert paper["vs_best"] == 1.5  # median of 2.0, 1.5, 800/700
    text = report.criteria_text(crit)
    assert "per repeat 1.50, 2.00, 1.60" in text


def test_a_single_run_passes_through() -> None:
    one = [r for r in RUNS if r["repeat"] == 1]
    rows = report.collapse(one)
    assert all(r["repeats"] == 1 and "spread" not in r for r in rows)
    crit = report.criteria(one)
    assert crit["paper"]["vs_rr"] == 2.0
    assert "per repeat" not in report.criteria_text(crit)
    table = report.tables(one, {"ablation_concurrency": 96})
    assert "median of" not in table and "900" in table


def test_a_variant_is_judged_by_the_same_criteria_and_reported_beside_oas(tmp_path: Path) -> None:
    variant = [dict(r, target="omni:oas_goodput",
                    summary=dict(r["summary"], goodput_requests_per_minute=2 * r["summary"][
                        "goodput_requests_per_minute"]))
               for r in RUNS if r["target"] == "omni:oas"]
    crit = report.criteria(RUNS + variant, ours="omni:oas_goodput")
    assert crit["ours"] == "omni:oas_goodput"
    assert crit["paper"]["vs_rr_per_repeat"] == [3.0, 4.0, 3.2]
    assert crit["paper"]["ranking"][0] == "omni:oas_goodput"
    assert "`oas_goodput` goodput / sglang round_robin" in report.criteria_text(crit)
    assert report.criteria(RUNS)["paper"]["vs_rr"] == 1.6  # omni:oas is unaffected
    text = report.write_report(RUNS + variant, {"ablation_concurrency": 96}, tmp_path, None)
    assert "criteria for omni:oas.\n" in text and "criteria for omni:oas_goodput.\n" in text


def test_steady_rates_leave_out_the_ramp_and_the_drain() -> None:
    import oas_eval  # noqa: E402  (benchmark/proxy is on the path above)

    from omniinfer.bench.client import RequestResult

    # 100 completions, one per model second from t=1 to t=100; the last ten take 10 s each
    # (a drain) and every fourth misses the TTFT objective
    done = [RequestResult(index=i, prompt_tokens=10, requested_output_tokens=1, output_tokens=1,
                          ttft=3.0 if i % 4 == 0 else 0.5, start=0.0,
                          end=float(i + 1) if i < 90 else 90.0 + 10.0 * (i - 89))
            for i in range(100)]
    rates = oas_eval.steady_rates(done, slo_ttft=2.0, slo_tpot=0.05)
    # the window is (11 s, 100 s] — the 11th and the 91st completion: requests 11..90, of
    # which 20 (every fourth) missed the objective; 80 completions in 89 s
    assert rates["steady_qpm"] == pytest.approx(80 / (89 / 60))
    assert rates["steady_goodput_qpm"] == pytest.approx(60 / (89 / 60))
    whole = 100 / (max(r.end for r in done) / 60.0)
    assert whole < 0.6 * rates["steady_qpm"]  # the 90 s drain costs the whole-run rate 40 %
    assert oas_eval.steady_rates(done[:5], 2.0, 0.05)["steady_qpm"] is None
