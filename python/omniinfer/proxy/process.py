"""Run the router as a child process (demo, tests, benchmarks), like ``launch.SGLangServer``.

The router runs in its own process group; ``stop`` ends the group. ``wait_ready`` waits for
``GET /health`` to answer 200, which means every role has at least one healthy worker.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from omniinfer.launch import ServerFailed, free_port


def router_command(args: Sequence[str], port: int, host: str = "127.0.0.1",
                   python: str = sys.executable) -> list[str]:
    """``python -m omniinfer.router --host H --port P ARGS``."""
    return [python, "-m", "omniinfer.router", "--host", host, "--port", str(port), *args]


class RouterProcess:
    """A running ``python -m omniinfer.router``; use as a context manager.

    Example: ``with RouterProcess(["--worker-urls", server.base_url], log) as router: ...``
    then send traffic to ``router.base_url``.
    """

    def __init__(self, args: Sequence[str], log_path: Path, port: int | None = None,
                 env: dict[str, str] | None = None, ready_timeout_s: float = 120.0,
                 wait_for: str = "/health") -> None:
        self.port = port or free_port()
        self.command = router_command(args, self.port)
        self.env = dict(os.environ if env is None else env)
        self.log_path = Path(log_path)
        self.ready_timeout_s = ready_timeout_s
        self.wait_for = wait_for
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def start(self) -> RouterProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.command, env=self.env, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerFailed(f"router exited with code {self.process.returncode}\n"
                                   f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base_url + self.wait_for, timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        raise ServerFailed(f"router not ready after {self.ready_timeout_s:.0f} s\n{self.log_tail()}")

    def stop(self, grace_s: float = 10.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        pgid = os.getpgid(self.process.pid)
        os.killpg(pgid, signal.SIGTERM)
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait()

    def __enter__(self) -> RouterProcess:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()
