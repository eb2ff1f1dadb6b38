"""Run a whole deployment on this machine: every server and the router, then wait.

Servers start at once on free ports (logs under ``log_dir``), are waited for together, then
the router starts in front of them. ``run`` returns when the caller's ``stop`` event is set
(Ctrl-C, SIGTERM) or any process dies, and stops every process it started either way: each
runs in its own process group and dies with this one, so nothing is left behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

from omniinfer.child_process import ManagedProcess, SGLangServerProcess, free_port
from omniinfer.cpu.server_env import cpu_env
from omniinfer.deploy.commands import Server, plain, router_args, server_command
from omniinfer.deploy.spec import DeployError, Deployment
from omniinfer.proxy.process import RouterProcess


class ServerProcess(SGLangServerProcess):
    """One SGLang server of the deployment (``role``: prefill or decode)."""

    def __init__(self, command: list[str], env: dict[str, str], log_path: Path, port: int,
                 role: str, ready_timeout_s: float = 600.0) -> None:
        super().__init__(command, env, log_path, port, ready_timeout_s, kind=f"{role} server")
        self.role = role


class Local:
    """The processes of one deployment on this machine."""

    def __init__(self, dep: Deployment, log_dir: Path, host: str = "127.0.0.1",
                 router_port: int | None = None, ready_timeout_s: float = 600.0) -> None:
        for group in dep.groups():
            if group.nnodes > 1:
                raise DeployError(f"{dep.source}: {group.role}.nnodes: {group.nnodes} nodes per "
                                  "instance cannot run on one machine; use --render")
        self.dep, self.log_dir, self.host = dep, Path(log_dir), host
        self.servers: list[tuple[Server, ServerProcess]] = []
        for group in dep.groups():
            # the CPU engine's environment on a CPU; elsewhere this process's, unchanged
            env = (cpu_env(threads_bind=_threads(group.tp)) if dep.device == "cpu"
                   else dict(os.environ))
            for index in range(group.count):
                spec = Server(group.role, index, host, free_port(),
                              free_port() if group.role == "prefill" else None)
                command = plain(server_command(dep, group, spec, host))
                log = self.log_dir / f"{spec.name}-{spec.port}.log"
                process = ServerProcess(command, env, log, spec.port, group.role,
                                        ready_timeout_s)
                self.servers.append((spec, process))
        prefills = [(s.url(), s.bootstrap_port or 0) for s, _ in self.servers
                    if s.role == "prefill"]
        decodes = [s.url() for s, _ in self.servers if s.role == "decode"]
        port = router_port or dep.router.port
        self.router = RouterProcess(plain(router_args(dep, prefills, decodes)), self.log_dir /
                                    "router.log", port=port, ready_timeout_s=ready_timeout_s)

    def processes(self) -> list[ManagedProcess]:
        return [p for _, p in self.servers] + [self.router]

    @contextlib.contextmanager
    def started(self) -> Iterator[Local]:
        try:
            for _, process in self.servers:
                process.launch()
            for _, process in self.servers:
                process.wait_ready()
            self.router.start()
            yield self
        finally:
            for process in reversed(self.processes()):
                process.stop()

    def describe(self) -> list[str]:
        lines = [f"{spec.name}: {spec.url()}" + (f" (bootstrap {spec.bootstrap_port})"
                                                 if spec.bootstrap_port else "")
                 + f"  log {process.log_path}" for spec, process in self.servers]
        return lines + [f"router: {self.router.base_url}  log {self.router.log_path}"]

    def first_dead(self) -> ManagedProcess | None:
        return next((p for p in self.processes() if not p.alive()), None)


def _threads(tp: int) -> str | None:
    """SGLang's CPU thread binding for ``tp`` ranks on this machine's cores (None for one)."""
    if tp == 1:
        return None
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // tp)
    return "|".join(",".join(str(c) for c in cores[i * per:(i + 1) * per] or cores[-1:])
                    for i in range(tp))


def run(dep: Deployment, log_dir: Path, stop: threading.Event | None = None,
        poll_s: float = 1.0, announce: bool = True) -> int:
    """Start everything, print the URLs, wait for ``stop`` (or SIGINT/SIGTERM) or a death."""
    stop = stop or threading.Event()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda *_: stop.set())
    local = Local(dep, log_dir)
    try:
        with local.started():
            if announce:
                print("\n".join(local.describe()), flush=True)
                print("serving; Ctrl-C stops every process", flush=True)
            while not stop.wait(poll_s):
                dead = local.first_dead()
                if dead is not None:
                    print(f"omniinfer deploy: {dead.kind} exited; stopping everything\n"
                          f"{dead.log_tail(20)}", flush=True)
                    return 1
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
