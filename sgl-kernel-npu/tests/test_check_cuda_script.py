"""The GPU check script's CPU fallback: interpreter correctness, then the no-GPU line."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "check_cuda.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the script runs the benchmark")
def test_check_cuda_without_gpu_runs_interpreter_check(capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    spec = importlib.util.spec_from_file_location("check_cuda", SCRIPT)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main([]) == 0
    printed = capsys.readouterr().out
    assert script.NO_GPU_LINE in printed
    assert "FAIL" not in printed
