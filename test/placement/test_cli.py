"""The ``omniinfer placement`` commands: outputs SGLang can load, and exit 2 on bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest

from omniinfer.cli import main


def _plan(counts, output, devices=2, redundant=0, *extra):
    """``omniinfer placement plan`` with these counts and fleet; its exit status."""
    return main(["placement", "plan", "--counts", str(counts), "--num-devices", str(devices),
                 "--num-redundant-experts", str(redundant), "--output", str(output), *extra])


def _simulate(output, devices, redundant, *extra):
    """``omniinfer placement simulate`` (no progress bar) into ``output``; its exit status."""
    return main(["placement", "simulate", "--num-devices", str(devices),
                 "--num-redundant-experts", str(redundant), "--output", str(output),
                 "--no-progress", *extra])


@pytest.fixture
def counts_file(tmp_path, olmoe):
    path = tmp_path / "counts.json"
    path.write_text(json.dumps({"logical_count": olmoe["wikipedia"].tolist()}))
    return path


def test_plan_writes_an_sglang_mapping_and_stats(tmp_path, counts_file, capsys):
    out = tmp_path / "plan.json"
    rc = _plan(counts_file, out, 16, 16, "--num-nodes", "2")
    assert rc == 0
    doc = json.loads(out.read_text())
    assert list(doc) == ["physical_to_logical_map"]  # SGLang passes every key as an argument
    mapping = np.array(doc["physical_to_logical_map"])
    assert mapping.shape == (3, 80)
    assert all(set(row.tolist()) == set(range(64)) for row in mapping)
    stats = json.loads((tmp_path / "plan.stats.json").read_text())
    assert all(r["b_after"] < r["b_before"] for r in stats["layers"])
    assert "B before" in capsys.readouterr().out


@pytest.mark.parametrize(
    "content, extra, message",
    [
        ({"logical_count": [[1, 2, 3, 4]]}, ["--num-devices", "3"], "does not divide"),
        ({"logical_count": [[1, -2, 3, 4]]}, [], "negative"),
        ({"logical_count": [[1, 2, 3, 4], [0, 0, 0, 0]]}, [], "no routed tokens"),
        ({"logical_count": [1, 2, 3, 4]}, [], "must be \\[layers, experts\\]"),
        ({"counts": [[1, 2]]}, [], "no 'logical_count' key"),
    ],
)
def test_plan_errors_exit_2_with_one_line(tmp_path, capsys, content, extra, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(content))
    rc = _plan(path, tmp_path / "p.json", 2, 0, *extra)
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err.startswith("omniinfer: error: ") and "\n" not in err
    assert pytest.importorskip("re").search(message, err)


def test_plan_nan_csv(tmp_path, capsys):
    path = tmp_path / "bad.csv"
    path.write_text("1,2,nan,4\n")
    rc = _plan(path, tmp_path / "p.json")
    assert rc == 2 and "NaN" in capsys.readouterr().err


def test_simulate_writes_summary_and_plot(tmp_path):
    rc = _simulate(tmp_path, 16, 16, "--windows", "12", "--regime", "6", "--seed", "1",
                   "--period", "4")
    assert rc == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["policies"]) == {"omni", "eplb-static", "eplb-periodic", "oracle"}
    assert summary["policies"]["eplb-static"]["experts_migrated"] == 0
    assert (tmp_path / "b_over_time.png").stat().st_size > 1000


def test_simulate_rejects_bad_shape(tmp_path, capsys):
    rc = _simulate(tmp_path, 12, 16)
    assert rc == 2 and "does not divide" in capsys.readouterr().err
