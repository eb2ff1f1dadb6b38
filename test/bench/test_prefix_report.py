"""The prefix evaluation's report and pure parts: the knee, paired ratios, measurement window."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
from report_rows import prefix_row as _row  # on cluster 8R

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark" / "proxy"))

import prefix_eval  # noqa: E402
import prefix_report  # noqa: E402

from omniinfer.bench.client import RequestResult  # noqa: E402

# sglang's best policy keeps >= 90 % up to rate 4 (the knee); 6 is 1.5x the knee
RUNS = [
    *(_row("omni:oas@kv-events", r, k, g * (1 + k), 0.99, 0.2) for k in (0, 1)
      for r, g in ((2, 100), (4, 300), (6, 450), (9, 500))),
    *(_row("sglang:round_robin", r, k, g * (1 + k), s, p) for k in (0, 1)
      for r, g, s, p in ((2, 100, 0.95, 0.4), (4, 150, 0.6, 1.5), (6, 100, 0.3, 5.0),
                         (9, 80, 0.1, 9.0))),
    *(_row("sglang:cache_aware", r, k, g * (1 + k), s, p) for k in (0, 1)
      for r, g, s, p in ((2, 100, 0.97, 0.3), (4, 240, 0.92, 0.8), (6, 300, 0.7, 1.2),
                         (9, 200, 0.4, 4.0))),
]


def test_criteria_at_the_knee_and_one_and_a_half_times_it() -> None:
    crit = prefix_report.criteria(RUNS, "8R", "prefix-groups")
    assert crit["knee"] == 4
    at_knee, above = crit["points"]
    assert above["rate"] == 6 and above["swept"]
    # repeat 1 doubles every router's goodput: paired ratios are unchanged by it
    assert at_knee["vs_rr"] == pytest.approx(2.0) and at_knee["vs_rr_per_repeat"] == [2.0, 2.0]
    assert at_knee["best_sglang"] == "sglang:cache_aware"
    assert at_knee["vs_best"] == pytest.approx(1.25)
    assert above["vs_best"] == pytest.approx(1.5) and above["p90_lower_by"] == pytest.approx(6.0)
    text = prefix_report.criteria_text(crit)
    assert "| 6.0 | P90 TTFT: sglang:cache_aware / ours | >= 3x | 6.00x" in text
    # at the knee the best peer policy is to be beaten 1.2x, at 1.5x the knee 1.5x
    assert "| 4.0 | goodput / best sglang-router (sglang:cache_aware) | >= 1.2x | 1.25x" in text
    assert "| 6.0 | goodput / best sglang-router (sglang:cache_aware) | >= 1.5x | 1.50x" in text
    assert text.count("| yes |") == 5


def test_no_knee_without_a_rate_the_sglang_router_serves() -> None:
    bad = [dict(r, slo_share=0.5) for r in RUNS if r["target"].startswith("sglang")]
    ours = [r for r in RUNS if r["target"].startswith("omni")]
    assert prefix_report.criteria(bad + ours, "8R", "prefix-groups")["knee"] is None


def test_tables_plots_and_failed_runs(tmp_path: Path) -> None:
    failed = {**RUNS[0], "failed": "router did not start"}
    text = prefix_report.write_report([*RUNS, failed], tmp_path)
    assert "| omni:oas@kv-events | 150 (100–200) / 0.20 s / 99%, 50% cached |" in text
    assert "Failed runs: 8R prefix-groups 2 omni:oas@kv-events" in text
    assert (tmp_path / "prefix_8R.png").stat().st_size > 20_000
    docs = tmp_path / "docs.md"
    docs.write_text(f"# x\n{prefix_report.START}\nold\n{prefix_report.END}\ntail\n")
    prefix_report.replace_block(docs, "new")
    assert docs.read_text() == f"# x\n{prefix_report.START}\nnew\n{prefix_report.END}\ntail\n"


def test_targets_parse_and_refuse_nonsense() -> None:
    t = prefix_eval.Target.parse("omni:oas@kv-events")
    assert (t.router, t.policy, t.truth) == ("omni", "oas", "kv-events")
    assert prefix_eval.Target.parse("sglang:cache_aware").truth == "router"
    for bad in ("oas", "sglang:cache_aware@kv-events", "other:oas"):
        with pytest.raises(ValueError, match="bad target"):
            prefix_eval.Target.parse(bad)


def _result(i: int, start: float, ttft: float | None, cached: int = 0) -> RequestResult:
    r = RequestResult(i, prompt_tokens=100, requested_output_tokens=3, output_tokens=3,
                      ttft=ttft, e2e=None if ttft is None else ttft + 0.02, start=start,
                      cached_tokens=cached, error=None if ttft is not None else "boom")
    return r


def test_measure_skips_the_warm_up_and_counts_errors_as_misses() -> None:
    args = argparse.Namespace(warmup_share=0.25, slo_ttft=1.0, slo_tpot=0.05)
    results = [_result(0, 0.0, 9.0), _result(1, 1.0, 0.5, 50), _result(2, 2.0, 2.0, 100),
               _result(3, 3.0, None), _result(4, 5.0, 0.1, 0)]
    m = prefix_eval.measure(list(reversed(results)), args)
    # request 0 (first sent) is the warm-up; of 4 measured, 2 meet the SLO over 4 s
    assert (m["measured"], m["errors"], m["good"]) == (4, 1, 2)
    assert m["slo_share"] == pytest.approx(0.5) and m["goodput_qpm"] == pytest.approx(30.0)
    assert m["cached_share"] == pytest.approx(150 / 300)


def test_requests_are_the_same_for_every_target_and_sized_by_rate() -> None:
    args = argparse.Namespace(run_seconds=4.0, output_len=8, seed=0, prefix_len=64, groups=4,
                              users_per_group=2, query_len=16, turns=4, turn_len=32,
                              think_time=0.5)
    a = prefix_eval.build_requests(args, "prefix-groups", 10.0, None, 1)
    assert a == prefix_eval.build_requests(args, "prefix-groups", 10.0, None, 1)
    assert len(a) == 40 and 2.5 < max(r.arrival_s for r in a) < 6.5  # 4 s at 10/s
    assert len(prefix_eval.build_requests(args, "prefix-groups", 20.0, None, 1)) == 80
    chats = prefix_eval.build_requests(args, "multi-turn", 10.0, None, 1)
    assert len(chats) == 40 and sum(r.after is None for r in chats) == 10


def test_plan_and_time_estimate() -> None:
    args = argparse.Namespace(clusters=["8R", "4P1D"], workloads=["prefix-groups", "multi-turn"],
                              rates=[4.0, 8.0], quick=True, run_seconds=2.0, time_scale=8.0,
                              targets=[1, 2], repeats=1, turns=4, think_time=0.25)
    assert prefix_eval.plan(args) == [("8R", "prefix-groups", 4.0), ("8R", "prefix-groups", 8.0),
                                      ("8R", "multi-turn", 8.0), ("4P1D", "prefix-groups", 4.0),
                                      ("4P1D", "prefix-groups", 8.0), ("4P1D", "multi-turn", 8.0)]
    # groups: 2 s of arrivals + 1 s drain; chats: 2 s + 4 turns x 0.75 s; all x 8, + overhead
    overhead = prefix_eval.RUN_OVERHEAD_S
    groups, chats = (2 + 1) * 8 + overhead, (2 + 3) * 8 + overhead
    assert prefix_eval.estimate_s(args) == pytest.approx(2 * 2 * (2 * groups + chats))


def test_a_peer_with_no_goodput_is_beaten_without_bound_and_two_zeros_are_no_pair() -> None:
    rows = [_row("omni:oas@kv-events", 6, 0, 450, 0.99, 0.2), _row("sglang:round_robin", 6, 0, 0, 0, 5),
            _row("omni:oas@kv-events", 6, 1, 0, 0, 9), _row("sglang:round_robin", 6, 1, 0, 0, 9),
            _row("omni:oas@kv-events", 6, 2, 300, 0.9, 0.5), _row("sglang:round_robin", 6, 2, 150, 0.5, 3)]
    ratios = prefix_report.paired(rows, "8R", "prefix-groups", 6, "omni:oas@kv-events",
                                  "sglang:round_robin")
    assert ratios == [float("inf"), 2.0]
    assert prefix_report._fmt(ratios[0], 2) == "∞" and prefix_report._fmt(None) == "n/a"
