"""How a real SGLang server runs on a machine without an accelerator: its flags and environment.

``CPU_FLAGS`` are the ``sglang.launch_server`` flags the CPU engine needs (device, attention
backend, no CUDA graphs, float32); ``cpu_env`` is the environment that selects the engine
(``SGLANG_USE_CPU_ENGINE=1``, offline Hugging Face hub, optionally SGLang's per-rank thread
binding). Used by ``omniinfer deploy`` for ``device: cpu`` and by the test bed
(:mod:`omniinfer.testbed.servers`). See docs/cpu.md. Pure Python.
"""

from __future__ import annotations

import os

CPU_FLAGS: tuple[str, ...] = (
    "--device", "cpu",
    "--attention-backend", "torch_native",
    "--cuda-graph-backend-decode", "disabled",
    "--cuda-graph-backend-prefill", "disabled",
    "--dtype", "float32",
)


def cpu_env(base: dict[str, str] | None = None, threads_bind: str | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with the CPU engine selected.

    ``threads_bind`` is SGLang's ``SGLANG_CPU_OMP_THREADS_BIND`` (cores per TP rank, ``|``
    between ranks)."""
    env = dict(os.environ if base is None else base)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    if threads_bind is not None:
        env["SGLANG_CPU_OMP_THREADS_BIND"] = threads_bind
    return env
