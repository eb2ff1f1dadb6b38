"""Child processes: the one helper for every process the package, benchmarks and tests start.

``ManagedProcess`` (start, wait until ready, stop or kill) and ``free_port`` are the one process
helper and the one port picker; routers, emulated workers and SGLang servers subclass the
helper. Each child runs in its own process group, so that stopping it also stops the processes
it spawned (an SGLang server's scheduler and detokenizer), and dies with the process that
started it.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PORT_RANGE = (10000, 21999)  # below the kernel's ephemeral range and SGLang's own picks
_handed_out: set[int] = set()


def free_port() -> int:
    """A TCP port free now, never the same twice in this process.

    Taken below the kernel's ephemeral range (and below SGLang's own choices, 22000-29999), so
    that no outgoing connection or ``bind(0)`` of another process -- a starting SGLang server
    opens dozens -- can take it between this call and the bind of the child it is meant for.
    """
    low, high = PORT_RANGE
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            high = min(high, int(f.read().split()[0]) - 1)
    except (OSError, ValueError, IndexError):
        pass
    pick = random.SystemRandom()
    for _ in range(256 if high > low else 0):
        port = pick.randint(low, high)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:  # no free port below the ephemeral range: any free one
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """In the child, before exec: ask Linux to SIGTERM it when the parent process dies."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class ServerFailed(RuntimeError):
    """The server exited or did not become ready; the message ends with its log tail."""


class ManagedProcess:
    """A child process in its own process group, ready when ``ready_path`` answers 200.

    The one helper for child processes of the package, benchmarks and tests. Output goes to
    ``log_path`` (``log_tail`` reads it back). Readiness is a GET of ``ready_path``, or a POST
    of ``ready_body`` as JSON when one is set (a router is ready once a request goes through).
    Use as a context manager; ``stop`` ends the whole group (the server and what it spawned),
    ``kill`` does it as a crash would.
    """

    kind = "process"
    ready_path = "/health"
    ready_body: dict[str, Any] | None = None
    poll_s = 0.5

    def __init__(
        self,
        command: Sequence[str],
        env: dict[str, str] | None,
        log_path: Path,
        port: int,
        ready_timeout_s: float = 600.0,
        *,
        kind: str | None = None,
        ready_path: str | None = None,
        ready_body: dict[str, Any] | None = None,
        poll_s: float | None = None,
    ) -> None:
        """The keyword settings override the class's (a subclass sets them once for its kind)."""
        self.kind = kind or self.kind
        self.ready_path = ready_path or self.ready_path
        self.ready_body = ready_body if ready_body is not None else self.ready_body
        self.poll_s = poll_s if poll_s is not None else self.poll_s
        self.command = list(command)
        self.env = dict(os.environ) if env is None else env
        self.log_path = Path(log_path)
        self.port = port
        self.ready_timeout_s = ready_timeout_s
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def launch(self) -> ManagedProcess:
        """Start the child without waiting for it (start several, then ``wait_ready`` each)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.command, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        return self

    def start(self) -> ManagedProcess:
        self.launch()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def ready(self, timeout_s: float = 30.0) -> bool:
        """One readiness probe: ``ready_path`` (with ``ready_body``, if any) answers 200."""
        data = None if self.ready_body is None else json.dumps(self.ready_body).encode()
        request = urllib.request.Request(self.base_url + self.ready_path, data=data,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerFailed(
                    f"{self.kind} exited with code {self.process.returncode}\n{self.log_tail()}"
                )
            if self.ready(timeout_s=max(min(30.0, deadline - time.monotonic()), 0.1)):
                return
            time.sleep(self.poll_s)
        raise ServerFailed(
            f"{self.kind} not ready after {self.ready_timeout_s:.0f} s\n{self.log_tail()}"
        )

    def stop(self, grace_s: float = 20.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        pgid = os.getpgid(self.process.pid)
        os.killpg(pgid, signal.SIGTERM)
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(pgid, signal.SIGKILL)  # children that outlived their parent too
        except ProcessLookupError:
            pass
        self.process.wait()

    def kill(self) -> None:
        """SIGKILL the whole group at once, as a crashed machine."""
        if self.process is None or self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(os.getpgid(self.process.pid), signal.SIGKILL)
        self.process.wait()

    def __enter__(self) -> ManagedProcess:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()


class SGLangServerProcess(ManagedProcess):
    """A ``python -m sglang.launch_server`` child: ready once it can generate
    (``GET /health_generate`` answers 200), probed every second."""

    kind = "server"
    ready_path = "/health_generate"
    poll_s = 1.0
