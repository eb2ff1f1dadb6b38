"""The router benchmarks' reports with either Rust peer: smg 1.13 (``smg:POLICY``, the default)
or sglang-router 0.3.2 (``sglang:POLICY``, older result files). The peer's round_robin and its
best policy (any of its policies that ran) are what the criteria compare against."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from report_rows import prefix_row

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark" / "proxy"))

import prefix_report  # noqa: E402
import report  # noqa: E402


def _oas(target: str, repeat: int, goodput: float, share: float, conc: int,
         workload: str = "paper", p99_ms: float = 2000.0) -> dict[str, Any]:
    return {"cluster": "4P1D", "workload": workload, "target": target, "concurrency": conc,
            "repeat": repeat, "slo_share": share, "ttfts": [p99_ms / 1000], "qpm": None,
            "summary": {"goodput_requests_per_minute": goodput, "requests_per_minute": 1000.0,
                        "p99_ttft_ms": p99_ms, "median_ttft_ms": p99_ms / 2,
                        "median_tpot_ms": 10.0, "errors": 0}}


# smg's round_robin misses the SLO at c=64 already, sglang-router's only at c=96; smg's best
# policy there is least_load, one sglang-router never had
OAS_RUNS = [
    *(_oas("omni:oas", k, g, 0.95, 64) for k, g in ((0, 900.0), (1, 800.0))),
    *(_oas("smg:round_robin", k, g, 0.5, 64) for k, g in ((0, 450.0), (1, 400.0))),
    *(_oas("smg:cache_aware", k, g, 0.7, 64) for k, g in ((0, 600.0), (1, 500.0))),
    *(_oas("smg:least_load", k, g, 0.8, 64) for k, g in ((0, 750.0), (1, 640.0))),
    *(_oas("sglang:round_robin", k, 300.0, 0.95, 64) for k in (0, 1)),
    *(_oas("sglang:cache_aware", k, 350.0, 0.95, 64) for k in (0, 1)),
    *(_oas("omni:oas", k, 1000.0, 0.9, 96) for k in (0, 1)),
    *(_oas("sglang:round_robin", k, 250.0, 0.4, 96) for k in (0, 1)),
    *(_oas("sglang:cache_aware", k, 500.0, 0.5, 96) for k in (0, 1)),
    # open loop: the lowest P99 of the peer is prefix_hash's
    _oas("omni:oas", 0, 900.0, 0.9, 0, "paper-open", 1000.0),
    _oas("smg:round_robin", 0, 500.0, 0.5, 0, "paper-open", 3000.0),
    _oas("smg:prefix_hash", 0, 600.0, 0.6, 0, "paper-open", 2000.0),
    _oas("sglang:round_robin", 0, 800.0, 0.8, 0, "paper-open", 1500.0),
]


def test_oas_report_compares_against_smg_when_it_ran() -> None:
    crit = report.criteria(OAS_RUNS)
    assert crit["peer"] == "smg" and crit["critical_concurrency"] == 64
    paper = crit["paper"]
    assert paper["best_sglang"] == "smg:least_load"  # the best of all smg policies
    assert paper["vs_rr_per_repeat"] == [2.0, 2.0]  # against smg:round_robin, pair by pair
    assert paper["vs_best_per_repeat"] == [1.2, 1.25]
    assert paper["ranking"] == ["omni:oas", "smg:least_load", "smg:cache_aware",
                                "smg:round_robin"]  # no sglang: target among them
    assert crit["paper_open"]["best_sglang"] == "smg:prefix_hash"
    assert crit["paper_open"]["p99_change"] == pytest.approx(-0.5)
    text = report.criteria_text(crit)
    assert "| paper: OAS goodput / smg round_robin | ≥ 1.5× | 2.00×" in text
    assert "best smg (smg:least_load)" in text and "sglang" not in text


def test_oas_report_peer_can_be_chosen_and_old_files_read_as_before(tmp_path: Path) -> None:
    crit = report.criteria(OAS_RUNS, peer="sglang")
    assert crit["critical_concurrency"] == 96
    assert crit["paper"]["best_sglang"] == "sglang:cache_aware"
    assert crit["paper"]["vs_rr"] == 4.0 and crit["paper_open"]["best_sglang"] == (
        "sglang:round_robin")
    old = [r for r in OAS_RUNS if not r["target"].startswith("smg:")]
    assert report.peer_prefix(old) == "sglang"
    assert report.criteria(old) == crit  # a file from before smg: the same criteria
    text = report.criteria_text(crit)
    assert "goodput / sglang round_robin" in text and "best sglang-router (" in text
    legacy = {key: value for key, value in crit.items() if key != "peer"}  # an old criteria.json
    assert report.criteria_text(legacy) == text
    report.write_report(OAS_RUNS, {"ablation_concurrency": 64}, tmp_path, None, peer="sglang")
    assert json.loads((tmp_path / "criteria.json").read_text())["peer"] == "sglang"
    report.write_report(OAS_RUNS, {"ablation_concurrency": 64}, tmp_path, None)
    written = json.loads((tmp_path / "criteria.json").read_text())
    assert written["paper"]["best_sglang"] == "smg:least_load"


_prefix = functools.partial(prefix_row, cluster="4P1D")


# smg's best policy (prefix_hash) keeps >= 90 % up to rate 4; sglang-router's up to 6
PREFIX_RUNS = [
    *(_prefix("omni:oas@kv-events", r, k, g, 0.99, 0.2) for k in (0, 1)
      for r, g in ((2, 100), (4, 300), (6, 450))),
    *(_prefix("smg:round_robin", r, k, g, s, p) for k in (0, 1)
      for r, g, s, p in ((2, 100, 0.95, 0.4), (4, 150, 0.6, 1.5), (6, 100, 0.3, 5.0))),
    *(_prefix("smg:prefix_hash", r, k, g, s, p) for k in (0, 1)
      for r, g, s, p in ((2, 100, 0.97, 0.3), (4, 250, 0.92, 0.8), (6, 300, 0.7, 1.2))),
    *(_prefix("sglang:cache_aware", r, k, g, 0.95, 0.5) for k in (0, 1)
      for r, g in ((2, 100), (4, 280), (6, 400))),
]


def test_prefix_report_compares_against_smg_when_it_ran() -> None:
    crit = prefix_report.criteria(PREFIX_RUNS, "4P1D", "prefix-groups")
    assert crit["peer"] == "smg" and crit["knee"] == 4
    at_knee, above = crit["points"]
    assert at_knee["best_sglang"] == "smg:prefix_hash" and at_knee["vs_rr"] == 2.0
    assert at_knee["vs_best"] == pytest.approx(1.2)
    assert above["rate"] == 6 and above["p90_lower_by"] == pytest.approx(6.0)
    text = prefix_report.criteria_text(crit)
    assert "| 4.0 | goodput / smg round_robin | >= 1.5x | 2.00x" in text
    assert "best smg (smg:prefix_hash)" in text
    assert "| 6.0 | P90 TTFT: smg:prefix_hash / ours | >= 3x | 6.00x" in text
    assert "sglang" not in text


def test_prefix_report_peer_can_be_chosen_and_old_files_read_as_before(tmp_path: Path) -> None:
    crit = prefix_report.criteria(PREFIX_RUNS, "4P1D", "prefix-groups", peer="sglang")
    assert crit["knee"] == 6 and crit["points"][0]["best_sglang"] == "sglang:cache_aware"
    assert crit["points"][0]["vs_rr"] is None  # no sglang:round_robin ran
    old = [r for r in PREFIX_RUNS if not r["target"].startswith("smg:")]
    assert prefix_report.criteria(old, "4P1D", "prefix-groups") == crit
    text = prefix_report.criteria_text(crit)
    assert "the best sglang-router policy keeps" in text
    legacy = {key: value for key, value in crit.items() if key != "peer"}
    assert prefix_report.criteria_text(legacy) == text
    none = {"cluster": "8R", "workload": "multi-turn", "knee": None}
    assert "no swept rate where a sglang-router policy" in prefix_report.criteria_text(none)
    prefix_report.write_report(PREFIX_RUNS, tmp_path, peer="sglang")
    assert json.loads((tmp_path / "criteria.json").read_text())[0]["knee"] == 6
