"""Values of the deployment file never reach a shell as code: every rendered command (the
``--render commands`` lines, the LeaderWorkerSet and RoleBasedGroup containers) is run here the
way its target runs it, with the server and router programs replaced by a recorder of their
argv; no hostile value runs anything, and each one arrives as one argument, unchanged."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from omniinfer.deploy import render
from omniinfer.deploy.spec import DeployError, load

HOSTILE = ["--x", "$(touch pwned-a)", "`touch pwned-b`", "; touch pwned-c", "a b  c", "it's",
           '"dq"', "$HOME", "${HOME}", "\\", "*", "~", "&& touch pwned-d", "| touch pwned-e",
           "> pwned-f", "http://$(touch pwned-g)", "$(LWS_LEADER_ADDRESS)", "$(POD_IP)", "$$",
           "$", "", "#", "!x", "'", "%s", "{a,b}", "x=$(touch pwned-h)", "é ü 字"]
MODEL = "$MODEL_DIR; touch pwned-model #"
PATTERN = "$(touch pwned-pattern).json"
ROUTER_ARGS = ["--y", "`touch pwned-r`", "$(touch pwned-s)", "a; touch pwned-t", "$HOME"]
RECORDER = '#!/bin/sh\nprintf "%s\\0" "$@" > "$ARGV_RECORD"\n'
HOSTS = {"PREFILL_0_HOST": "10.0.0.1", "PREFILL_0_NODE_1_HOST": "10.0.0.3",
         "DECODE_0_HOST": "10.0.0.2"}
POD_ENV = {"LWS_LEADER_ADDRESS": "lead-0.omni-prefill", "LWS_WORKER_INDEX": "1",
           "LWS_GROUP_SIZE": "2", "POD_IP": "10.1.1.1"}


def _hostile_file(tmp_path: Path) -> Path:
    data = {"model": MODEL, "device": "gpu", "transfer_backend": "mooncake",
            "prefill": {"count": 1, "tp": 2, "nnodes": 2, "omni_attn_pattern": PATTERN,
                        "args": list(HOSTILE)},
            "decode": {"count": 1, "omni_attn_pattern": PATTERN, "args": list(HOSTILE)},
            "router": {"args": list(ROUTER_ARGS)},
            "kubernetes": {"name": "omni"}}
    path = tmp_path / "hostile.yaml"
    path.write_text(yaml.safe_dump(data, allow_unicode=True))
    return path


class Runner:
    """Runs commands in an empty directory, with ``python``/``python3`` a recorder on PATH."""

    def __init__(self, tmp_path: Path) -> None:
        self.bin, self.cwd = tmp_path / "bin", tmp_path / "cwd"
        self.bin.mkdir()
        self.cwd.mkdir()
        for name in ("python", "python3"):
            (self.bin / name).write_text(RECORDER)
            (self.bin / name).chmod(0o755)
        self.record = tmp_path / "argv.bin"

    def run(self, argv: list[str], extra_env: dict[str, str]) -> list[str]:
        """``argv`` run without a shell of ours; returns the recorder's arguments."""
        if self.record.exists():
            self.record.unlink()
        env = {"PATH": f"{self.bin}:/usr/bin:/bin", "HOME": "/home/someone",
               "ARGV_RECORD": str(self.record), **extra_env}
        done = subprocess.run(argv, cwd=self.cwd, env=env, capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, (argv, done.stderr)
        assert self.record.exists(), f"the program never ran: {argv}"
        raw = self.record.read_bytes()
        assert raw.endswith(b"\0") or raw == b""
        return [part.decode() for part in raw.split(b"\0")[:-1]]

    def created(self) -> list[str]:
        return sorted(os.listdir(self.cwd))


def _kubelet_expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion of a container's command and args, as the kubelet does
    it (k8s.io/kubernetes third_party/forked/golang/expansion): ``$$`` is one ``$``, ``$(NAME)``
    is NAME's value when the container defines it and stays as written otherwise."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "$" and i + 1 < len(text):
            nxt = text[i + 1]
            if nxt == "$":
                out.append("$")
                i += 2
                continue
            if nxt == "(":
                end = text.find(")", i + 2)
                if end != -1:
                    name = text[i + 2:end]
                    out.append(env.get(name, text[i:end + 1]))
                    i = end + 1
                    continue
                out.append("$(")
                i += 2
                continue
            out.append("$" + nxt)
            i += 2
            continue
        out.append(text[i])
        i += 1
    return "".join(out)


def _check_server(argv: list[str], role: str) -> None:
    assert argv[:2] == ["-m", "sglang.launch_server"], argv
    assert argv[argv.index("--model-path") + 1] == MODEL
    assert argv[argv.index("--omni-attn-pattern") + 1] == PATTERN
    assert argv[argv.index("--disaggregation-mode") + 1] == role
    assert argv[-len(HOSTILE):] == HOSTILE


def _check_router(argv: list[str], prefill: str, decode: str) -> None:
    assert argv[:2] == ["-m", "omniinfer.router"], argv
    assert argv[argv.index("--model-path") + 1] == MODEL
    assert argv[argv.index("--prefill") + 1:argv.index("--prefill") + 3] == [prefill, "8998"]
    assert argv[argv.index("--decode") + 1] == decode
    assert argv[-len(ROUTER_ARGS):] == ROUTER_ARGS


def test_rendered_command_lines_run_no_value_and_pass_each_unchanged(tmp_path: Path) -> None:
    runner = Runner(tmp_path)
    text = render.commands(load(_hostile_file(tmp_path)))
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert len(lines) == 4  # prefill nodes 0 and 1, decode, router
    seen = []
    for line in lines:
        argv = runner.run(["/bin/sh", "-c", line], HOSTS)
        assert runner.created() == [], (line, runner.created())
        seen.append(argv)
    _check_server(seen[0], "prefill")
    _check_server(seen[1], "prefill")
    _check_server(seen[2], "decode")
    for argv, rank in zip(seen[:2], ("0", "1"), strict=True):
        assert argv[argv.index("--node-rank") + 1] == rank
        assert argv[argv.index("--dist-init-addr") + 1] == "10.0.0.1:20000"
    _check_router(seen[3], "http://10.0.0.1:30000", "http://10.0.0.2:30000")


def _containers(doc: Any) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    if isinstance(doc, dict):
        for key, value in doc.items():
            if key == "containers":
                found += value
            else:
                found += _containers(value)
    elif isinstance(doc, list):
        for item in doc:
            found += _containers(item)
    return found


@pytest.mark.parametrize("kind", ["lws", "rbg"])
def test_pods_run_no_value_and_pass_each_unchanged(tmp_path: Path, kind: str) -> None:
    """Each container's ``command`` + ``args`` after the kubelet's ``$(VAR)`` expansion, run as
    the container runtime runs them (no shell added; a ``sh -c`` in the manifest is run)."""
    runner = Runner(tmp_path)
    dep = load(_hostile_file(tmp_path))
    text = render.manifests_yaml(render.lws(dep) if kind == "lws" else render.rbg(dep))
    # an RBG leader patch names its container without a command (it adds ports and a probe)
    containers = [c for c in _containers(list(yaml.safe_load_all(text))) if "command" in c]
    assert len(containers) == (4 if kind == "lws" else 3)
    routers = 0
    for container in containers:
        argv = [_kubelet_expand(part, POD_ENV)
                for part in container["command"] + container.get("args", [])]
        recorded = runner.run(argv, POD_ENV)
        assert runner.created() == [], (argv, runner.created())
        if container["name"] == "omniproxy":
            routers += 1
            prefill = ("http://omni-prefill-0.omni-prefill:30000" if kind == "lws"
                       else "http://omni-prefill-0.s-omni-prefill:30000")
            decode = ("http://omni-decode-0.omni-decode:30000" if kind == "lws"
                      else "http://omni-decode-0.s-omni-decode:30000")
            _check_router(recorded, prefill, decode)
        else:
            role = container["name"].removeprefix("sglang-")
            _check_server(recorded, role)
            if "--node-rank" in recorded:
                assert recorded[recorded.index("--node-rank") + 1] in ("0", "1")
                assert recorded[recorded.index("--dist-init-addr") + 1] == (
                    "lead-0.omni-prefill:20000")
    assert routers == 1


@pytest.mark.parametrize("value", ["a\nb", "x\rtouch pwned", "a\x00b", "\x1b[2J", "a\u2028b"])
def test_a_value_with_a_line_break_or_control_character_is_refused(tmp_path: Path,
                                                                   value: str) -> None:
    """A rendered line is one line: a value that would break it (or hide in a terminal) stops
    the file with one error naming the key."""
    for where in ("model", "prefill.args", "router.args", "decode.omni_attn_pattern"):
        data: dict[str, Any] = {"model": "m", "prefill": {}, "decode": {}}
        if where == "model":
            data["model"] = value
        elif where.endswith("args"):
            data[where.split(".")[0]] = {"args": ["--flag", value]}
        else:
            data["decode"] = {"omni_attn_pattern": value}
        path = tmp_path / "f.yaml"
        path.write_text(yaml.safe_dump(data))  # escaped: the YAML itself is one line a key
        with pytest.raises(DeployError) as err:
            load(path)
        message = str(err.value)
        assert where in message and "\n" not in message and "\r" not in message, message


def test_the_cli_render_of_a_hostile_file_is_safe_end_to_end(tmp_path: Path) -> None:
    """The same through ``omniinfer deploy FILE --render commands`` as a user runs it."""
    runner = Runner(tmp_path)
    done = subprocess.run([sys.executable, "-m", "omniinfer", "deploy",
                           str(_hostile_file(tmp_path)), "--render", "commands"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for line in done.stdout.splitlines():
        if line and not line.startswith("#"):
            runner.run(["/bin/sh", "-c", line], HOSTS)
    assert runner.created() == []
