"""Helpers of the emulator tests: emulated workers as child processes, HTTP calls, SSE parsing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from omniinfer.launch import free_port

CAPTURE = Path(__file__).with_name("sglang_0.5.23_capture.json")


class Emulator:
    def __init__(self, port: int, proc: subprocess.Popen[bytes], log: Path, bootstrap_port: int | None = None) -> None:
        self.port, self.proc, self.log, self.bootstrap_port = port, proc, log, bootstrap_port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def wait_http(url: str, proc: subprocess.Popen[bytes] | None, log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited: {log.read_text(errors='replace')[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready after {timeout} s: {log.read_text(errors='replace')[-2000:]}")


def start_emulator(tmp: Path, *args: str, profile: str = "cpu-smollm2", time_scale: str = "0.02") -> Emulator:
    port = free_port()
    bootstrap = None
    extra = list(args)
    if "prefill" in extra:
        bootstrap = free_port()
        extra += ["--disaggregation-bootstrap-port", str(bootstrap)]
    log = tmp / f"emulator-{port}.log"
    cmd = [sys.executable, "-m", "omniinfer.emulator", "--profile", profile, "--port", str(port),
           "--time-scale", time_scale, *extra]
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    wait_http(f"http://127.0.0.1:{port}/health", proc, log)
    return Emulator(port, proc, log, bootstrap)


def request(url: str, method: str = "GET", body: Any = None, raw: bytes | None = None,
            content_type: str = "application/json", timeout: float = 60) -> tuple[int, str]:
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", content_type)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def sse_events(text: str) -> list[str]:
    return [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
