"""scripts/demo.sh: the whole system (deploy/omni-1p1d-cpu.yaml: SmolLM2-MoE 1P1D, expert
parallelism, the pattern and placement on both servers, OmniProxy oas in front), an answer, the
table and a line per technique."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from omni_testing import ROOT

pytestmark = pytest.mark.server


def test_demo_answers_and_prints_benchmark_table(tmp_path: Path) -> None:
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "demo.sh"), "--output-dir", str(tmp_path),
         "--num-requests", "4", "--concurrency", "2", "--input-len", "64", "--output-len", "16"],
        capture_output=True, text=True, timeout=1200,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    answer = next(line for line in result.stdout.splitlines() if line.startswith("[demo] A:"))
    assert "Paris" in answer
    assert "Requests per minute (QPM)" in result.stdout and "Completed / errors" in result.stdout
    assert "4 / 0" in result.stdout
    assert (tmp_path / "bench-summary.json").is_file()
    assert "[demo] servers and router stopped" in result.stdout
    assert "OmniProxy (oas, PD mode) in front" in result.stdout
    lines = result.stdout.splitlines()
    attn = next(line for line in lines if line.startswith("[demo] OmniAttn (decode server):"))
    assert "16 of 30 layers compressed" in attn
    sent = next(line for line in lines if line.startswith("[demo] OmniAttn (PD transfer):"))
    assert "% saved" in sent
    oas = next(line for line in lines if line.startswith("[demo] OmniProxy (OAS) decisions"))
    assert "prefill:" in oas and "decode:" in oas
    placement = next(line for line in lines
                     if line.startswith("[demo] OmniPlacement (decode server):"))
    assert int(placement.split(", ")[1].split()[0]) >= 1, placement  # migrations adopted
