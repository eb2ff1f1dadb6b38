"""Emulated PD clusters and routers as child processes (each in its own process group).

``EmulatedCluster(n_prefill, n_decode, profile, time_scale)`` starts ``omniinfer
emulate-worker`` processes; ``router_command`` builds the command line of OmniProxy or of the
upstream ``sglang_router`` for it; ``Proc`` stops a process group by its id.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proc:
    """One child process in its own group; ``stop`` ends the group (TERM, then KILL)."""

    def __init__(self, command: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.command = command
        self.log = log
        with open(log, "wb") as f:
            self.popen = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT,
                                          start_new_session=True, env=env)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, grace_s: float = 5.0) -> None:
        if self.popen.poll() is not None:
            return
        pgid = self.popen.pid  # the group id is the leader's pid (start_new_session)
        os.killpg(pgid, signal.SIGTERM)
        try:
            self.popen.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.popen.wait()

    def tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-2000:]
        except OSError:
            return ""


def wait_ok(url: str, proc: Proc, timeout_s: float = 60.0, method: str = "GET",
            body: dict | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{proc.command[:4]} exited:\n{proc.tail()}")
        try:
            data = None if body is None else json.dumps(body).encode()
            req = urllib.request.Request(url, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready after {timeout_s:.0f} s:\n{proc.tail()}")


def kv_events_args() -> list[str]:
    """``--kv-events-config`` of one emulator: SGLang's ZMQ publisher on a free port."""
    return ["--kv-events-config",
            json.dumps({"publisher": "zmq", "endpoint": f"tcp://*:{free_port()}"})]


class EmulatedCluster:
    """``n_prefill`` prefill and ``n_decode`` decode emulators of one profile (each publishing
    its KV events if ``kv_events``, for a router with ``--cache-truth kv-events``)."""

    def __init__(self, n_prefill: int, n_decode: int, profile: str, time_scale: float,
                 log_dir: Path, extra: tuple[str, ...] = (), kv_events: bool = False) -> None:
        self.prefill: list[tuple[str, int]] = []  # (url, bootstrap port)
        self.decode: list[str] = []
        self.procs: list[Proc] = []
        log_dir.mkdir(parents=True, exist_ok=True)
        base = [sys.executable, "-m", "omniinfer", "emulate-worker", "--profile", profile,
                "--time-scale", str(time_scale), *extra]
        try:
            events = kv_events_args if kv_events else list
            for i in range(n_prefill):
                port, boot = free_port(), free_port()
                self.procs.append(Proc([*base, "--port", str(port), "--disaggregation-mode",
                                        "prefill", "--disaggregation-bootstrap-port", str(boot),
                                        *events()], log_dir / f"prefill{i}.log"))
                self.prefill.append((f"http://127.0.0.1:{port}", boot))
            for i in range(n_decode):
                port = free_port()
                self.procs.append(Proc([*base, "--port", str(port), "--disaggregation-mode",
                                        "decode", *events()], log_dir / f"decode{i}.log"))
                self.decode.append(f"http://127.0.0.1:{port}")
            for proc, url in zip(self.procs, self.urls(), strict=True):
                wait_ok(url + "/health", proc)
        except BaseException:
            self.stop()
            raise

    def urls(self) -> list[str]:
        return [u for u, _ in self.prefill] + self.decode

    def prefill_busy_s(self) -> list[float]:
        """Each prefill worker's cumulative busy time (wall seconds, from /v1/loads)."""
        out = []
        for url, _ in self.prefill:
            with urllib.request.urlopen(url + "/v1/loads", timeout=5) as r:
                out.append(sum(load["total_prefill_busy_us"] for load in json.load(r)["loads"]) / 1e6)
        return out

    def flush(self, timeout_s: float = 60.0) -> None:
        """Empty every worker's prefix cache (waits until each is idle)."""
        for url in self.urls():
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    req = urllib.request.Request(url + "/flush_cache", data=b"", method="POST")
                    with urllib.request.urlopen(req, timeout=5) as r:
                        if r.status == 200:
                            break
                except (urllib.error.URLError, OSError):
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{url} did not become idle")
                time.sleep(0.3)

    def stop(self) -> None:
        for proc in self.procs:
            proc.stop()


def omni_router_args(cluster: EmulatedCluster, prefill_policy: str, decode_policy: str,
                     access_log: Path | None = None, cache_truth: str = "router",
                     ttft_slo_secs: float | None = None) -> list[str]:
    args = ["--pd-disaggregation", "--cache-truth", cache_truth,
            "--prefill-policy", prefill_policy, "--decode-policy", decode_policy, "--log-level", "warn",
            "--loads-poll-interval-secs", "0.5", "--max-concurrent-requests", "4096"]
    for url, boot in cluster.prefill:
        args += ["--prefill", url, str(boot)]
    for url in cluster.decode:
        args += ["--decode", url]
    if access_log is not None:
        args += ["--access-log", str(access_log)]
    if ttft_slo_secs is not None:
        args += ["--oas-ttft-slo-secs", f"{ttft_slo_secs:g}"]
    return args


def sglang_router_command(cluster: EmulatedCluster, prefill_policy: str, decode_policy: str,
                          port: int) -> list[str]:
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
           "--host", "127.0.0.1", "--port", str(port), "--prefill-policy", prefill_policy,
           "--decode-policy", decode_policy, "--log-level", "warn"]
    for url, boot in cluster.prefill:
        cmd += ["--prefill", url, str(boot)]
    for url in cluster.decode:
        cmd += ["--decode", url]
    return cmd


def omni_router_command(args: list[str], port: int) -> list[str]:
    return [sys.executable, "-m", "omniinfer.router", "--host", "127.0.0.1", "--port",
            str(port), *args]


def start_router(command: list[str], port: int, log: Path) -> Proc:
    """Start a router and wait until one tiny request goes through it."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = Proc(command, log, env)
    try:
        wait_ok(f"http://127.0.0.1:{port}/generate", proc, 90.0, "POST",
                {"input_ids": [11, 12, 13], "sampling_params": {"max_new_tokens": 1}})
    except BaseException:
        proc.stop()
        raise
    return proc
