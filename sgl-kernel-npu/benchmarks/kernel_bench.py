"""What the device scripts share: importing the kernels, errors, timers, the compile report.

``device_check.py`` (the one-command check) and ``check_cuda.py`` (the older decode-only one)
time and report the kernels the same way through these helpers.
"""

from __future__ import annotations

import datetime
import importlib
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

PACKAGE = Path(__file__).resolve().parents[1]


def import_kernels() -> SimpleNamespace:
    """The kernel, reference, index and input modules, from a plain checkout if need be.

    Import only once ``TRITON_INTERPRET`` is final: triton reads it when a kernel is defined.
    """
    if str(PACKAGE) not in sys.path:
        sys.path.insert(0, str(PACKAGE))  # a plain checkout works without installing
    mods = {n: importlib.import_module(f"omni_kernel_npu.omni_attn.{n}") for n in
            ("decode_sink_recent", "extend_sink_recent", "reference", "indices", "testing")}
    return SimpleNamespace(dec=mods["decode_sink_recent"], ext=mods["extend_sink_recent"],
                           ref=mods["reference"], idx=mods["indices"], testing=mods["testing"])


def max_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute difference, compared in fp32 on ``out``'s device."""
    return float((out.float() - ref.to(out.device)).abs().max())


def make_timer(device: str, flush_bytes: int = 256 << 20) -> Callable[..., dict[str, float]]:
    """``timer(fn, iters, warmup, cold=True)`` -> median/min ms. On CUDA: events per call,
    optionally after overwriting the L2 (a layer's KV is cold in real decode); on CPU:
    perf_counter."""
    flush = torch.empty(flush_bytes, dtype=torch.int8, device=device) if device == "cuda" else None

    def timer(fn: Callable[[], Any], iters: int, warmup: int, cold: bool = True
              ) -> dict[str, float]:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            if flush is None:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
                continue
            if cold:
                flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return {"median_ms": statistics.median(times), "min_ms": min(times)}

    return timer


def graph_ms(fn: Callable[[], Any], reps: int = 20, iters: int = 10) -> float | None:
    """Per-call GPU time without launch overhead: ``reps`` calls in one CUDA graph replayed
    back to back (L2 warm). None when capture fails."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
        graph.replay()
        times = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / reps)
        return statistics.median(times)
    except Exception as exc:  # capture is best effort (e.g. a host sync inside fn): report it
        print(f"  graph capture failed: {type(exc).__name__}: {exc}"[:200])
        torch.cuda.synchronize()
        return None


def compile_report(kernels: Any) -> dict[str, Any]:
    """What each launched kernel was compiled for, from the compiled handle's metadata/asm."""
    report = {}
    for name, handle in kernels.last_compiled().items():
        asm = getattr(handle, "asm", {}) or {}
        meta = getattr(handle, "metadata", None)
        ptx = asm.get("ptx", "")
        ptx_target = re.search(r"^\s*\.target\s+(\S+)", ptx, re.M) if isinstance(ptx, str) else None
        report[name] = {
            "target": str(getattr(meta, "target", None)),
            "asm_kinds": sorted(asm.keys()),
            "ptx_target": ptx_target.group(1) if ptx_target else None,
            "num_warps": getattr(meta, "num_warps", None),
            "shared_bytes": getattr(meta, "shared", None),
            "n_regs": getattr(handle, "n_regs", None),
            "n_spills": getattr(handle, "n_spills", None),
            "cuda": "cubin" in asm and "ptx" in asm,
        }
    return report


def environment(device: str) -> dict[str, Any]:
    """Versions, the device and its capability, and when the run happened."""
    import triton

    env = {"python": platform.python_version(), "torch": torch.__version__,
           "triton": triton.__version__, "device": device,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name(0)
        env["capability"] = list(torch.cuda.get_device_capability(0))
    return env
