"""Run the router as a child process (demo, tests, benchmarks): a ``child_process.ManagedProcess``.

The router runs in its own process group; ``stop`` ends the group. ``wait_ready`` waits for
``GET /health`` to answer 200, which means every role has at least one healthy worker.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from omniinfer.child_process import ManagedProcess, free_port


def router_command(args: Sequence[str], port: int, host: str = "127.0.0.1",
                   python: str = sys.executable) -> list[str]:
    """``python -m omniinfer.router --host H --port P ARGS``."""
    return [python, "-m", "omniinfer.router", "--host", host, "--port", str(port), *args]


class RouterProcess(ManagedProcess):
    """A running ``python -m omniinfer.router``; use as a context manager.

    Example: ``with RouterProcess(["--worker-urls", server.base_url], log) as router: ...``
    then send traffic to ``router.base_url``.
    """

    kind = "router"
    poll_s = 0.2

    def __init__(self, args: Sequence[str], log_path: Path, port: int | None = None,
                 env: dict[str, str] | None = None, ready_timeout_s: float = 120.0,
                 wait_for: str = "/health") -> None:
        port = port or free_port()
        super().__init__(router_command(args, port), dict(os.environ if env is None else env),
                         Path(log_path), port, ready_timeout_s)
        self.ready_path = wait_for

    def stop(self, grace_s: float = 10.0) -> None:
        super().stop(grace_s)
