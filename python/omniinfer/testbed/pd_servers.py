"""Start real SGLang prefill and decode servers on the CPU engine (tests, demo, benchmarks).

The commands are the stock ones (``python -m sglang.launch_server ... --disaggregation-mode
prefill|decode --disaggregation-transfer-backend mooncake_tcp``); the plugin fills in the CPU
defaults (see :mod:`omniinfer.cpu.server_defaults`). KV moves between the servers through
Mooncake's TCP transport. All servers start at once and are waited for together, so a 1P1D
cluster costs about one server start.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from omniinfer.child_process import ManagedProcess, ServerFailed, free_port
from omniinfer.cpu.server_env import cpu_env
from omniinfer.testbed.servers import SGLangServer, cpu_server_command

TRANSFER_BACKEND = "mooncake_tcp"
LOADS_PATH = "/v1/loads?include=disagg,queues"


def pd_server_args(mode: str, bootstrap_port: int | None = None) -> list[str]:
    """The PD flags of one server; ``bootstrap_port`` only for a prefill server."""
    if mode not in ("prefill", "decode"):
        raise ValueError(f"mode must be prefill or decode, got {mode!r}")
    args = ["--disaggregation-mode", mode, "--disaggregation-transfer-backend", TRANSFER_BACKEND]
    if mode == "prefill":
        args += ["--disaggregation-bootstrap-port", str(bootstrap_port or free_port())]
    return args


class PDServer(SGLangServer):
    """One real prefill or decode server; a prefill server also has its bootstrap port."""

    def __init__(self, command: Sequence[str], env: dict[str, str], log_path: Path, port: int,
                 mode: str, bootstrap_port: int | None) -> None:
        super().__init__(command, env, log_path, port)
        self.mode = mode
        self.bootstrap_port = bootstrap_port
        self.kind = f"{mode} server"

    def router_args(self) -> list[str]:
        """``--prefill URL BOOTSTRAP_PORT`` or ``--decode URL``, as both routers take them."""
        if self.mode == "prefill":
            return ["--prefill", self.base_url, str(self.bootstrap_port)]
        return ["--decode", self.base_url]


def pd_server(model: str | Path, mode: str, log_dir: Path, max_total_tokens: int = 16384,
              extra_args: Sequence[str] = (), name: str | None = None) -> PDServer:
    """A not yet started prefill or decode server with free ports."""
    port = free_port()
    bootstrap = free_port() if mode == "prefill" else None
    command = cpu_server_command(model, port, max_total_tokens,
                                 [*pd_server_args(mode, bootstrap), *extra_args])
    log = Path(log_dir) / f"{name or mode}-{port}.log"
    return PDServer(command, cpu_env(), log, port, mode, bootstrap)


def plain_server(model: str | Path, log_dir: Path, max_total_tokens: int = 16384,
                 extra_args: Sequence[str] = ()) -> SGLangServer:
    port = free_port()
    command = cpu_server_command(model, port, max_total_tokens, list(extra_args))
    return SGLangServer(command, cpu_env(), Path(log_dir) / f"plain-{port}.log", port)


@contextlib.contextmanager
def started(servers: Sequence[SGLangServer]) -> Iterator[list[SGLangServer]]:
    """Start every server at once, wait for all, stop all on exit (also when one fails)."""
    try:
        for server in servers:
            server.launch()
        for server in servers:
            server.wait_ready()
        yield list(servers)
    finally:
        for server in servers:
            server.stop()


def router_args(servers: Sequence[PDServer]) -> list[str]:
    """``--pd-disaggregation --prefill ... --decode ...`` for these servers."""
    args = ["--pd-disaggregation"]
    for server in servers:
        args += server.router_args()
    return args


class SGLangRouterProcess(ManagedProcess):
    """The real ``python -m sglang_router.launch_router`` in PD mode (the peer router).

    Its ``/health`` answers before it has found its workers healthy, so it counts as ready
    only once one tiny request has gone through it.
    """

    kind = "sglang-router"
    poll_s = 0.5

    def wait_ready(self) -> None:
        super().wait_ready()
        body = json.dumps({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}})
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            request = urllib.request.Request(self.base_url + "/generate", data=body.encode(),
                                             headers={"Content-Type": "application/json"})
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(request, timeout=60) as response:
                    if response.status == 200:
                        return
            time.sleep(self.poll_s)
        raise ServerFailed(f"sglang-router served nothing in {self.ready_timeout_s:.0f} s\n"
                           f"{self.log_tail()}")


def sglang_router(servers: Sequence[PDServer], log_path: Path, policy: str = "round_robin",
                  decode_policy: str | None = None) -> SGLangRouterProcess:
    """A not yet started ``sglang_router.launch_router`` in front of these PD servers."""
    port = free_port()
    command = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
               "--port", str(port), *router_args(servers), "--prefill-policy", policy,
               "--decode-policy", decode_policy or policy, "--log-level", "warn",
               "--prometheus-port", str(free_port())]  # its default 29000 clashes between routers
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return SGLangRouterProcess(command, env, Path(log_path), port, ready_timeout_s=120.0)


def load(url: str, timeout: float = 10.0) -> dict[str, Any]:
    """The first DP rank's ``/v1/loads`` entry with its disaggregation and queue sections."""
    with urllib.request.urlopen(url + LOADS_PATH, timeout=timeout) as response:
        return dict(json.loads(response.read())["loads"][0])


def held(entry: dict[str, Any]) -> dict[str, int]:
    """What a server still holds for requests: running, queued, KV tokens in use; 0s when idle."""
    out = {
        "running": int(entry.get("num_running_reqs", 0)),
        "waiting": int(entry.get("num_waiting_reqs", 0)),
        "used_tokens": int(entry.get("num_used_tokens", 0)),
    }
    for key, value in (entry.get("disaggregation") or {}).items():
        if key.endswith("_queue_reqs"):
            out[key] = int(value)
    for key, value in (entry.get("queues") or {}).items():
        out[f"queue_{key}"] = int(value)
    return out


def wait_idle(url: str, timeout_s: float = 60.0) -> dict[str, int]:
    """Poll until the server holds nothing; returns the last reading (non-zero if it timed out)."""
    deadline = time.monotonic() + timeout_s
    while True:
        reading = held(load(url))
        if not any(reading.values()) or time.monotonic() > deadline:
            return reading
        time.sleep(0.5)
