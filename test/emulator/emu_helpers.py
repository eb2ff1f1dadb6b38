"""Helpers of the emulator tests: emulated workers as child processes, HTTP calls, SSE parsing."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from omni_testing import wait_until  # noqa: F401  (re-exported for the tests)
from omniinfer.child_process import free_port
from omniinfer.emulator.process import EmulatorProcess

CAPTURE = Path(__file__).with_name("sglang_0.5.23_capture.json")


def start_emulator(tmp: Path, *extra: str, mode: str = "null", profile: str = "cpu-smollm2",
                   time_scale: float = 0.02) -> EmulatorProcess:
    """A started emulated worker logging into ``tmp``; stop it with ``.stop()``."""
    port = free_port()
    emu = EmulatorProcess(mode, profile, time_scale, port=port, extra_args=extra,
                          log_path=tmp / f"emulator-{mode}-{port}.log")
    emu.start()
    return emu


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
