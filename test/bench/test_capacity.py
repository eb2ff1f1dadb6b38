"""SLO capacity from a rate sweep (benchmark/proxy/capacity_math.py, capacity.py's workloads)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark" / "proxy"))

from capacity import at_rate, base_requests, slow_profile, target_list  # noqa: E402
from capacity_math import capacity_at, summarize_capacity, value_at  # noqa: E402

from omniinfer.emulator.profile import load_profile  # noqa: E402


def test_capacity_interpolates_between_the_bracketing_points() -> None:
    points = [(1000.0, 1.0), (2000.0, 0.95), (3000.0, 0.85), (4000.0, 0.5)]
    rate, bound = capacity_at(points, 0.9)
    assert bound == ""
    assert rate == pytest.approx(2500.0)
    assert capacity_at(points, 0.99)[0] == pytest.approx(1000.0 + 1000.0 * 0.01 / 0.05)


def test_capacity_takes_the_first_crossing_and_reports_bounds() -> None:
    noisy = [(1.0, 0.95), (2.0, 0.85), (3.0, 0.92), (4.0, 0.4)]
    assert capacity_at(noisy, 0.9)[0] == pytest.approx(1.5)
    assert capacity_at([(5.0, 0.5), (6.0, 0.4)], 0.9) == (5.0, "<")
    assert capacity_at([(5.0, 1.0), (6.0, 0.95)], 0.9) == (6.0, ">=")
    with pytest.raises(ValueError):
        capacity_at([], 0.9)


def test_value_at_interpolates_inside_and_refuses_outside() -> None:
    pts = [(10.0, 100.0), (20.0, 300.0)]
    assert value_at(pts, 15.0) == pytest.approx(200.0)
    assert value_at(pts, 20.0) == pytest.approx(300.0)
    assert value_at(pts, 25.0) is None
    assert value_at(pts, 5.0) is None


def _row(target: str, repeat: int, qpm: float, share: float, p99: float, errors: int = 0) -> dict:
    return {"cluster": "4P1D", "workload": "paper", "target": target, "repeat": repeat,
            "qpm": qpm, "slo_share": share,
            "summary": {"p99_ttft_ms": p99, "errors": errors}}


def test_summary_compares_oas_with_the_best_peer_of_each_repeat() -> None:
    rows = []
    for rep in (0, 1):
        rows += [_row("omni:oas", rep, 1000, 1.0, 500), _row("omni:oas", rep, 2000, 0.95, 900),
                 _row("omni:oas", rep, 3000, 0.5, 4000),
                 _row("smg:a", rep, 1000, 0.95, 800), _row("smg:a", rep, 2000, 0.5, 5000),
                 _row("smg:b", rep, 1000, 0.99, 700, errors=1),
                 _row("smg:b", rep, 2000, 0.8 - 0.1 * rep, 3000)]
    panel = summarize_capacity(rows)["paper on 4P1D"]
    oas, b = panel["targets"]["omni:oas"], panel["targets"]["smg:b"]
    assert oas["cap90"] == pytest.approx(2000 + 1000 * 0.05 / 0.45)
    assert b["errors"] == 2  # one per repeat: a peer's failures are counted, never dropped
    assert panel["ratios"][0] == pytest.approx(oas["cap90"] / (1000 + 1000 * 0.09 / 0.19))
    assert panel["ratios"][1] > panel["ratios"][0]  # b is worse in the second repeat
    assert any("median oas / best smg" in line for line in panel["verdict"])
    assert all(r is not None and r < 1 for r in panel["p99_ratios"])


def test_trace_rates_keep_the_traces_shape_and_paper_is_poisson() -> None:
    reqs = base_requests("azure", 50, 0, 100, 0.05)
    assert reqs[0].arrival_s == 0.0 and len(reqs) == 50
    fast = at_rate(reqs, "azure", 6000.0, 1)
    span = fast[-1].arrival_s
    assert 60.0 * 49 / span == pytest.approx(6000.0)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(reqs, reqs[1:], strict=False)]
    fgaps = [b.arrival_s - a.arrival_s for a, b in zip(fast, fast[1:], strict=False)]
    ratios = {round(f / g, 6) for f, g in zip(fgaps, gaps, strict=True) if g > 0}
    assert len(ratios) == 1  # one compression for the whole window: bursts stay bursts
    paper = at_rate(base_requests("paper", 400, 0, 0, 0.05), "paper", 1200.0, 3)
    assert 60.0 * 400 / paper[-1].arrival_s == pytest.approx(1200.0, rel=0.15)


def test_slow_profile_scales_every_prefill_term_and_nothing_else(tmp_path: Path) -> None:
    base = load_profile("h100-llama3-8b")
    slow = load_profile(slow_profile("h100-llama3-8b", 1.5, tmp_path))
    for name in ("prefill_base_s", "prefill_per_request_s", "prefill_per_token_s",
                 "prefill_attention_s"):
        assert getattr(slow.cost, name) == pytest.approx(1.5 * getattr(base.cost, name))
    assert slow.cost.decode_base_s == base.cost.decode_base_s
    assert slow.capacity == base.capacity


def test_markdown_lists_every_target_best_first_with_its_errors() -> None:
    from capacity_math import markdown

    rows = [_row("omni:oas", 0, 1000, 1.0, 500), _row("omni:oas", 0, 2000, 0.5, 900),
            _row("smg:a", 0, 1000, 0.5, 800, errors=3)]
    text = markdown(summarize_capacity(rows))
    lines = [ln for ln in text.splitlines() if ln.startswith("| omni") or ln.startswith("| smg")]
    assert lines[0].startswith("| omni:oas") and lines[1].startswith("| smg:a | < 1,000")
    assert lines[1].endswith("| 3 |")
    assert "median oas / best smg" in text


def test_targets_add_the_kv_event_mode_and_the_chosen_peer() -> None:
    plain = [t.name for t in target_list(None)]
    assert plain[0] == "omni:oas" and all(n.startswith("smg:") for n in plain[1:])
    assert not any("@kv-events" in n for n in plain)
    both = target_list("omni:oas,omni:oas@kv-events,sglang:cache_aware", "oas", "sglang-router",
                       kv_events=True)
    assert [(t.name, t.cache_truth) for t in both] == [
        ("omni:oas", "router"), ("omni:oas@kv-events", "kv-events"),
        ("sglang:cache_aware", "router")]
    assert both[2].router == "sglang" and both[2].policy == "cache_aware"
