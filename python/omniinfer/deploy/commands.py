"""Command lines of a deployment: one ``sglang.launch_server`` per server, one router.

The same builders serve the local run (``local.py``, free ports on this machine) and the
renders for other machines (``render.py``, fixed ports and host placeholders), so what a user
starts here is what they deploy there.
"""

from __future__ import annotations

import dataclasses
import shlex
import sys

from omniinfer.deploy.spec import Deployment, Group
from omniinfer.launch import CPU_FLAGS

SERVER_PORT = 30000  # fixed ports of the multi-node render
BOOTSTRAP_PORT = 8998
DIST_PORT = 20000


@dataclasses.dataclass(frozen=True)
class Server:
    """One prefill or decode instance: where it listens, and (multi-node) which node it is."""

    role: str
    index: int
    host: str
    port: int
    bootstrap_port: int | None  # prefill only
    node_rank: int = 0
    dist_init_addr: str | None = None  # multi-node: the instance's first node

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    def url(self, host: str | None = None) -> str:
        return f"http://{host or self.host}:{self.port}"


def server_args(dep: Deployment, group: Group, server: Server, listen: str) -> list[str]:
    """``sglang.launch_server`` flags of one server (``listen``: its ``--host``)."""
    args = ["--model-path", dep.model, "--host", listen, "--port", str(server.port),
            "--disaggregation-mode", group.role,
            "--disaggregation-transfer-backend", dep.transfer_backend]
    if server.bootstrap_port is not None:
        args += ["--disaggregation-bootstrap-port", str(server.bootstrap_port)]
    if dep.max_total_tokens is not None:
        args += ["--max-total-tokens", str(dep.max_total_tokens)]
    if group.tp > 1:
        args += ["--tp", str(group.tp)]
    if group.ep > 1:
        args += ["--ep", str(group.ep)]
    if group.nnodes > 1:
        assert server.dist_init_addr is not None
        args += ["--nnodes", str(group.nnodes), "--node-rank", str(server.node_rank),
                 "--dist-init-addr", server.dist_init_addr]
    if dep.device == "cpu":
        args += list(CPU_FLAGS)
    if group.omni_attn_pattern:
        args += ["--omni-attn-pattern", group.omni_attn_pattern]
    if group.omni_placement:
        args += ["--enable-omni-placement"]
    return args + list(group.args)


def server_command(dep: Deployment, group: Group, server: Server, listen: str,
                   python: str = sys.executable) -> list[str]:
    return [python, "-m", "sglang.launch_server", *server_args(dep, group, server, listen)]


def router_args(dep: Deployment, prefills: list[tuple[str, int]], decodes: list[str]) -> list[str]:
    """``python -m omniinfer.router`` flags in PD mode over these workers (URL, bootstrap
    port), without ``--host``/``--port`` (``proxy.process.router_command`` adds them)."""
    args = ["--pd-disaggregation"]
    for url, bootstrap in prefills:
        args += ["--prefill", url, str(bootstrap)]
    for url in decodes:
        args += ["--decode", url]
    args += ["--prefill-policy", dep.router.prefill_policy,
             "--decode-policy", dep.router.decode_policy, "--model-path", dep.model]
    return args + list(dep.router.args)


def shell(command: list[str]) -> str:
    """One shell line; ``$VAR`` placeholders stay unquoted so the shell fills them in."""
    return " ".join(part if part.startswith("$") or part.startswith("http://$")
                    else shlex.quote(part) for part in command)
