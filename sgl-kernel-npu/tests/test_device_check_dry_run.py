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
    assert result["skipped"] == []
    assert all(v is not False for v in result["ok"].values())
    assert "verdicts" in proc.stdout and "FAIL" not in proc.stdout


def test_budget_skips_and_records() -> None:
    budget = _load("device_check").Budget(0.0)
    assert budget.allows("decode timing at 2048") is False
    assert budget.skipped and "decode timing at 2048" in budget.skipped[0]
    assert _load("device_check").Budget(1e6).allows("x") is True


def test_staging_verification_sees_a_wrong_copy() -> None:
    staging = _load("staging_check")
    src = torch.arange(6.0)
    pairs = [(src, src.clone())]
    assert staging._intact(pairs, [src])
    pairs[0][1][3] = -1.0
    assert not staging._intact(pairs, [src])
