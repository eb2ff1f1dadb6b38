"""Real SGLang servers on the CPU engine, started on this machine for tests, benchmarks, the demo.

``cpu_server_command`` is the stock ``python -m sglang.launch_server`` command line with the CPU
flags (:data:`omniinfer.cpu.server_env.CPU_FLAGS`); ``SGLangServer`` runs it as a
:class:`~omniinfer.child_process.SGLangServerProcess` (ready once the server can
generate).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from omniinfer.child_process import SGLangServerProcess
from omniinfer.cpu.server_env import CPU_FLAGS


def cpu_server_command(
    model_path: str | Path,
    port: int,
    max_total_tokens: int = 16384,
    extra_args: Sequence[str] = (),
    python: str = sys.executable,
) -> list[str]:
    """The ``python -m sglang.launch_server`` command line for the CPU engine."""
    return [
        python, "-m", "sglang.launch_server",
        "--model-path", str(model_path),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--max-total-tokens", str(max_total_tokens),
        *CPU_FLAGS,
        *extra_args,
    ]


class SGLangServer(SGLangServerProcess):
    """A running ``sglang.launch_server`` of the test bed (readiness as the product's)."""
