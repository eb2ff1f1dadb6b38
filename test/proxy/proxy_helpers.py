"""Helpers for the router tests: emulated workers as subprocesses, HTTP calls, SSE parsing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from omni_testing import get, post, sse_events  # noqa: F401  (re-exported for the tests)
from omniinfer.launch import free_port

HERE = Path(__file__).resolve().parent


class EmulatedWorkerProcess:
    """One ``proxy_emulated_worker.py`` (EmulatedPDWorker) in its own process group."""

    def __init__(self, role: str = "regular", token_delay: float = 0.002,
                 port: int | None = None) -> None:
        self.role = role
        self.port = port or free_port()
        self.command = [sys.executable, str(HERE / "proxy_emulated_worker.py"),
                        "--port", str(self.port), "--role", role,
                        "--token-delay", str(token_delay)]
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> EmulatedWorkerProcess:
        self.process = subprocess.Popen(self.command, start_new_session=True,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    return self
            except (urllib.error.URLError, OSError):
                time.sleep(0.1)
        raise RuntimeError(f"emulated worker on {self.port} did not start")

    def configure(self, **settings: Any) -> None:
        post(self.url + "/_emulated/config", settings)

    def log(self) -> dict[str, Any]:
        return get(self.url + "/_emulated/log")[1]

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(os.getpgid(self.process.pid), signal.SIGKILL)
            self.process.wait()

    def __enter__(self) -> EmulatedWorkerProcess:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.kill()


def wait_until(predicate: Any, timeout: float = 10.0, step: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return False
