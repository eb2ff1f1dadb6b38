"""An emulated worker as a child process (tests, benchmarks): a ``child_process.ManagedProcess``.

``EmulatorProcess("prefill", time_scale=0.02)`` picks free ports, starts ``python -m
omniinfer.emulator`` in its own process group and is ready when ``/health`` answers. It also
speaks the emulator's own routes: ``set_faults`` / ``clear_faults`` (``/emulator/faults``) and
``received`` (``/emulator/requests``).
"""

from __future__ import annotations

import json
import sys
import tempfile
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omniinfer.child_process import ManagedProcess, free_port


class EmulatorProcess(ManagedProcess):
    """One ``omniinfer emulate-worker`` process; ``mode`` is null, prefill or decode."""

    kind = "emulator"
    poll_s = 0.05

    def __init__(self, mode: str = "null", profile: str = "cpu-smollm2", time_scale: float = 0.02,
                 port: int | None = None, bootstrap_port: int | None = None,
                 extra_args: Sequence[str] = (), log_path: Path | None = None,
                 env: dict[str, str] | None = None, ready_timeout_s: float = 60.0) -> None:
        if mode not in ("null", "prefill", "decode"):
            raise ValueError(f"mode must be null, prefill or decode, got {mode!r}")
        port = port or free_port()
        self.mode = mode
        self.bootstrap_port = (bootstrap_port or free_port()) if mode == "prefill" else None
        command = [sys.executable, "-m", "omniinfer.emulator", "--profile", profile,
                   "--port", str(port), "--time-scale", f"{time_scale:g}",
                   "--disaggregation-mode", mode]
        if self.bootstrap_port is not None:
            command += ["--disaggregation-bootstrap-port", str(self.bootstrap_port)]
        command += list(extra_args)
        if log_path is None:
            log_path = Path(tempfile.gettempdir()) / f"omniinfer-emulator-{mode}-{port}.log"
        super().__init__(command, env, log_path, port, ready_timeout_s)

    @property
    def url(self) -> str:
        return self.base_url

    def router_args(self) -> list[str]:
        """``--prefill URL BOOTSTRAP_PORT``, ``--decode URL`` or ``--worker-urls URL``."""
        if self.mode == "prefill":
            return ["--prefill", self.url, str(self.bootstrap_port)]
        if self.mode == "decode":
            return ["--decode", self.url]
        return ["--worker-urls", self.url]

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    def set_faults(self, **switches: Any) -> dict[str, Any]:
        """Change fault switches (see ``omniinfer.emulator.faults``); returns all of them."""
        return dict(self._call("POST", "/emulator/faults", switches))

    def clear_faults(self) -> dict[str, Any]:
        return dict(self._call("DELETE", "/emulator/faults"))

    def received(self) -> dict[str, list[dict[str, Any]]]:
        """``{"requests": [...], "aborts": [...]}`` as the worker received them."""
        return dict(self._call("GET", "/emulator/requests"))

    def aborted_rids(self) -> list[str]:
        return [a["rid"] for a in self.received()["aborts"]]

    def load(self) -> dict[str, Any]:
        """The ``/v1/loads`` entry of its one DP rank."""
        return dict(self._call("GET", "/v1/loads")["loads"][0])

    def stop(self, grace_s: float = 10.0) -> None:
        super().stop(grace_s)
