"""Helpers of the emulator tests: emulated workers as child processes, HTTP calls, SSE parsing,
and small profiles for the engine driven in-process."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from omni_testing import wait_until  # noqa: F401  (re-exported for the tests)
from omniinfer.child_process import free_port
from omniinfer.emulator.process import EmulatorProcess
from omniinfer.emulator.profile import Capacity, CostCoefficients, ModelInfo, Profile, Transfer

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


# per pass: 10 ms prefill + 1 ms a token; decode: 20 ms + 1 ms a request + 1 us a KV token
LINEAR_COST = {"prefill_base_s": 0.01, "prefill_per_token_s": 0.001, "decode_base_s": 0.02,
               "decode_per_request_s": 0.001, "decode_per_kv_token_s": 1e-6}


def small_profile(name: str, capacity: dict[str, Any], cost: dict[str, float] | None = None,
                  transfer: dict[str, float] | None = None, **extra: Any) -> Profile:
    """A profile of model ``m`` (100,000-token context, 100,000-token pool unless ``capacity``
    says otherwise) costing ``LINEAR_COST`` plus the terms in ``cost``; ``transfer`` and
    ``extra`` (``moe``, ``attn_pattern``) go to ``Profile`` as given (defaults where absent)."""
    return Profile(
        name=name, description="", model=ModelInfo("m", "m", context_length=100_000),
        capacity=Capacity(**{"max_total_tokens": 100_000, **capacity}),
        cost=CostCoefficients(**{**LINEAR_COST, **(cost or {})}),
        transfer=Transfer(**(transfer or {})), **extra)


def ids(n: int, start: int = 1000) -> list[int]:
    """``n`` consecutive token ids from ``start``."""
    return list(range(start, start + n))
