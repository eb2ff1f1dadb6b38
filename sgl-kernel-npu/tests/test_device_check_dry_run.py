"""The device check's dry run (every step on CPU, interpreter, tiny shapes) and its guards.

The dry run goes through a subprocess, as a user would start it: the script must pick the
interpreter itself before the kernels are defined.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str) -> ModuleType:
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dry_run_covers_every_step(tmp_path: Path) -> None:
    out = tmp_path / "dc.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(BENCH / "device_check.py"), "--dry-run",
                           "--out", str(out)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["dry_run"] is True and result["environment"]["device"] == "cpu"
    cfg = result["config"]
    rows = result["correctness"]
    assert len(rows) == 2 * (len(cfg["contexts"]) * len(cfg["pages"]) + 2)
    assert {r["kernel"] for r in rows} == {"decode", "extend"}
    assert {r["dtype"] for r in rows} == {"bfloat16", "float16", "float32"}
    assert {r["page_size"] for r in rows} == {1, 16, 64}
    assert all(r["ok"] and r["err_sink_recent"] <= r["tol"] <= 3e-2 and r["gap_to_full"] > 0.09
               for r in rows)
    assert [r["context"] for r in result["decode"]] == cfg["contexts"]
    for r in result["decode"]:
        assert r["sink_recent"]["median_ms"] > 0 and r["speedup_vs_full_triton"] > 0
    assert result["extend"]["ok"] and result["extend"]["full_triton"]["median_ms"] > 0
    staging = result["staging"]
    assert staging["intact"] is True and staging["streams"] is False
    assert staging["slowdown_same_stream"] > 0 and staging["layers"] == 2
    slot_rows = result["slot_map"]
    assert len(slot_rows) == 2 * len(cfg["slot_map_contexts"]) * len(cfg["pages"])
    assert {(r["kernel"], r["page_size"]) for r in slot_rows} == {
        (k, p) for k in ("decode", "extend") for p in (1, 16, 64)}
    assert all(r["ok"] and r["finite"] and r["err"] <= r["tol"] and r["evicted_slots"] > 0
               for r in slot_rows)
    timing = result["slot_map_timing"]
    assert timing["identical"] and timing["context"] == cfg["slot_map_timing_context"]
    assert timing["no_map"]["median_ms"] > 0 and timing["slot_map"]["median_ms"] > 0
    placement = result["placement"]
    assert placement["imports"]["ok"] and placement["imports"]["sglang_imported"] is False
    assert placement["imports"]["from"] == "python/omniinfer/placement/staging.py"
    assert placement["platform"]["is_device"] is False
    stager = placement["stager"]
    assert stager["dedicated_stream"] and stager["local"] and stager["received"]
    assert stager["sent"] and placement["staging"]["intact"] is True
    assert placement["staging"]["staged_mb"] > 0 and placement["host_copy"]["ok"] is True
    assert result["skipped"] == []
    assert result["steps"] == ["correctness", "slot_map", "timings", "staging", "placement"]
    assert all(v is not False for v in result["ok"].values())
    assert "verdicts" in proc.stdout and "FAIL" not in proc.stdout


def test_budget_skips_and_records() -> None:
    budget = _load("device_check").Budget(0.0)
    assert budget.allows("decode timing at 2048") is False
    assert budget.skipped and "decode timing at 2048" in budget.skipped[0]
    assert _load("device_check").Budget(1e6).allows("x") is True


def test_steps_select_and_reject() -> None:
    check = _load("device_check")
    assert check._parse(["--steps", "slot_map,placement"]).steps == ["slot_map", "placement"]
    with pytest.raises(SystemExit):
        check._parse(["--steps", "slot_map,nope"])


def test_placement_check_catches_a_stager_that_drops_a_copy(monkeypatch: Any) -> None:
    """The real-staging check must fail when a staged slot never reaches the live weights."""
    check = _load("placement_staging_check")
    cfg = dict(_load("device_check").DRY, staging_reps=1)
    mods, _ = check.import_placement()
    real_stage = mods.staging.SlotStager.stage

    def lossy(self: Any, copies: Any) -> Any:
        staged = real_stage(self, copies)
        staged.copies.pop(next(iter(staged.copies)))
        return staged

    monkeypatch.setattr(mods.staging.SlotStager, "stage", lossy)
    assert check.run_placement_staging(cfg, "cpu")["staging"]["intact"] is False


def test_staging_verification_sees_a_wrong_copy() -> None:
    staging = _load("staging_check")
    src = torch.arange(6.0)
    pairs = [(src, src.clone())]
    assert staging._intact(pairs, [src])
    pairs[0][1][3] = -1.0
    assert not staging._intact(pairs, [src])
