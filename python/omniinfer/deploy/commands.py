"""Command lines of a deployment: one ``sglang.launch_server`` per server, one router.

The same builders serve the local run (``local.py``, free ports on this machine) and the
renders for other machines (``render.py``, fixed ports and host placeholders), so what a user
starts here is what they deploy there.

A command is a list of ``Arg``: a plain ``str`` is a literal, always (every value from the
deployment file is one); a ``Word`` holds the ``Var`` placeholders that only the renderer
creates (a host, the leader's address, a worker's index), with literal text around them. The
distinction is by type, never by looking at the text, so no value of the file can become a
placeholder. ``shell`` single-quotes every literal and writes a Var as ``"${NAME}"``;
``kube_args`` doubles every ``$`` of a literal (the kubelet reads ``$$`` as one ``$`` and
expands nothing else in it) and writes a Var as ``$(NAME)``; ``plain`` is the local run's argv,
which has no Vars.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import sys
from collections.abc import Sequence

from omniinfer.cpu.server_env import CPU_FLAGS
from omniinfer.deploy.spec import Deployment, Group

SERVER_PORT = 30000  # fixed ports of the multi-node render
BOOTSTRAP_PORT = 8998
DIST_PORT = 20000


_VAR_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")
_PLAIN = re.compile(r"[\w@%+=:,./-]*", re.ASCII)  # what shlex.quote leaves unquoted


@dataclasses.dataclass(frozen=True)
class Var:
    """A value the target fills in when the command runs: an environment variable of the
    machine or the pod (``PREFILL_0_HOST``, ``LWS_LEADER_ADDRESS``). Created by the renderer
    only, from names it chooses; the name is an upper-case identifier (checked)."""

    name: str

    def __post_init__(self) -> None:
        if not _VAR_NAME.fullmatch(self.name):
            raise ValueError(f"not a placeholder name: {self.name!r}")


@dataclasses.dataclass(frozen=True)
class Word:
    """One argument made of literal text and ``Var``s, e.g. ``http://`` + host + ``:30000``.
    Build it with ``word``; a ``Word`` always holds at least one ``Var``."""

    parts: tuple[str | Var, ...]

    def resolve(self, values: dict[str, str]) -> str:
        """The argument once each Var is replaced by its value in ``values``."""
        return "".join(values[p.name] if isinstance(p, Var) else p for p in self.parts)


Arg = str | Word


def word(*parts: str | Var | Word) -> Arg:
    """``parts`` joined into one argument: a ``Word`` if any part holds a Var, else ``str``."""
    flat: list[str | Var] = []
    for part in parts:
        for piece in (part.parts if isinstance(part, Word) else (part,)):
            if isinstance(piece, str) and flat and isinstance(flat[-1], str):
                flat[-1] += piece
            elif isinstance(piece, Var) or piece:
                flat.append(piece)
    if all(isinstance(p, str) for p in flat):
        return "".join(p for p in flat if isinstance(p, str))
    return Word(tuple(flat))


def shell(command: Sequence[Arg]) -> str:
    """One POSIX shell line running ``command``: each literal single-quoted where needed (so
    ``$``, backticks, ``;``, quotes, spaces and globs stay text), each Var ``"${NAME}"``.
    The line has no line break as long as no literal has one (``spec`` refuses them)."""
    return " ".join(_shell_word(arg) if isinstance(arg, Word) else shlex.quote(arg)
                    for arg in command)


def _shell_word(arg: Word) -> str:
    if all(_PLAIN.fullmatch(p) for p in arg.parts if isinstance(p, str)):
        return '"' + "".join(f"${{{p.name}}}" if isinstance(p, Var) else p
                             for p in arg.parts) + '"'
    return "".join(f'"${{{p.name}}}"' if isinstance(p, Var) else shlex.quote(p)
                   for p in arg.parts)


def kube_args(command: Sequence[Arg]) -> list[str]:
    """``command`` as a container's ``command`` array, run without a shell: the kubelet
    expands ``$(NAME)`` there, so each literal's ``$`` is doubled (``$$`` is one ``$`` after
    expansion) and each Var is written ``$(NAME)``."""
    def one(part: str | Var) -> str:
        return f"$({part.name})" if isinstance(part, Var) else part.replace("$", "$$")

    return ["".join(one(p) for p in arg.parts) if isinstance(arg, Word) else one(arg)
            for arg in command]


def plain(command: Sequence[Arg]) -> list[str]:
    """The argv of a command without placeholders (the local run's); a Var is a bug here."""
    out = []
    for arg in command:
        if isinstance(arg, Word):
            raise TypeError(f"a placeholder in a local command: {arg}")
        out.append(arg)
    return out


@dataclasses.dataclass(frozen=True)
class Server:
    """One prefill or decode instance: where it listens, and (multi-node) which node it is."""

    role: str
    index: int
    host: Arg
    port: int
    bootstrap_port: int | None  # prefill only
    node_rank: int | Var = 0
    dist_init_addr: Arg | None = None  # multi-node: the instance's first node

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    def url(self, host: Arg | None = None) -> Arg:
        return word("http://", host or self.host, f":{self.port}")


def server_args(dep: Deployment, group: Group, server: Server, listen: str) -> list[Arg]:
    """``sglang.launch_server`` flags of one server (``listen``: its ``--host``); every value
    of the file is one literal argument."""
    args: list[Arg] = ["--model-path", dep.model, "--host", listen, "--port", str(server.port),
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
        rank = server.node_rank
        args += ["--nnodes", str(group.nnodes),
                 "--node-rank", word(rank) if isinstance(rank, Var) else str(rank),
                 "--dist-init-addr", server.dist_init_addr]
    if dep.device == "cpu":
        args += list(CPU_FLAGS)
    if group.omni_attn_pattern:
        args += ["--omni-attn-pattern", group.omni_attn_pattern]
    if group.omni_placement:
        args += ["--enable-omni-placement"]
    return args + list(group.args)


def server_command(dep: Deployment, group: Group, server: Server, listen: str,
                   python: str = sys.executable) -> list[Arg]:
    """``python -m sglang.launch_server`` and ``server_args``."""
    return [python, "-m", "sglang.launch_server", *server_args(dep, group, server, listen)]


def router_args(dep: Deployment, prefills: Sequence[tuple[Arg, int]],
                decodes: Sequence[Arg]) -> list[Arg]:
    """``python -m omniinfer.router`` flags in PD mode over these workers (URL, bootstrap
    port), without ``--host``/``--port`` (``proxy.process.router_command`` puts them before
    these arguments)."""
    args: list[Arg] = ["--pd-disaggregation"]
    for url, bootstrap in prefills:
        args += ["--prefill", url, str(bootstrap)]
    for url in decodes:
        args += ["--decode", url]
    args += ["--prefill-policy", dep.router.prefill_policy,
             "--decode-policy", dep.router.decode_policy, "--model-path", dep.model]
    return args + list(dep.router.args)
