"""The kernels lower to PTX and a cubin for sm_90 on this host, no GPU needed.

The interpreter never runs Triton's compiler, so type or shape errors that only the compiled
path sees would slip through the other tests; this compiles the real kernels in a subprocess
with the interpreter off (the compile cache makes reruns cheap).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(importlib.util.find_spec("triton.backends.nvidia") is None,
                    reason="this triton has no CUDA backend (e.g. triton-ascend)")
def test_kernels_compile_for_cuda_sm90() -> None:
    env = dict(os.environ, TRITON_INTERPRET="0",
               PYTHONPATH=os.pathsep.join(p for p in (str(PKG), os.environ.get("PYTHONPATH"))
                                          if p))
    proc = subprocess.run(
        [sys.executable, "-m", "omni_kernel_npu.omni_attn.aot", "--arch", "90", "--json"],
        cwd=PKG, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(report) == {"stage1_head_fp32_indexed_cap", "stage1_grouped_bf16",
                           "stage2_merge_bf16", "extend_dot_bf16", "extend_vector_fp32_cap"}
    for name, kernel in report.items():
        assert "cuda" in kernel["target"], name
        assert {"ptx", "cubin"} <= set(kernel["asm_kinds"]), name
        assert kernel["ptx_target"].startswith("sm_90"), name
        # no tl.dot, written or made by Triton's combiner, in the fp32 kernels (TF32 on CUDA)
        if "fp32" in name:
            assert kernel["tt_dot_ops"] == 0, name
    assert report["stage1_grouped_bf16"]["tt_dot_ops"] > 0  # the count does see dots
