"""The deployment file is hostile input: oversized, binary, an alias bomb, duplicate keys, huge
counts, names Kubernetes refuses, values too long to quote. Each stops ``omniinfer deploy``
with one short line ``omniinfer deploy: error: FILE: ...`` and exit status 2, never a
traceback, and without reading or building more than the caps allow."""

from __future__ import annotations

import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from omniinfer.cli import main
from omniinfer.deploy import spec
from omniinfer.deploy.spec import DeployError, load

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "deploy" / "omni-1p1d-cpu.yaml"
MAX_FILE_BYTES = 1 << 20  # the documented cap
GOOD = "model: m\nprefill: {count: 1}\ndecode: {count: 1}\n"


def _bomb(levels: int = 6, width: int = 10) -> str:
    """A "billion laughs" under a typed key: ``width ** levels`` leaves from a few lines."""
    parts = ["&l0 [" + ", ".join(["lol"] * width) + "]"]
    for level in range(1, levels):
        parts.append(f"&l{level} [" + ", ".join([f"*l{level - 1}"] * width) + "]")
    return "model: [" + ", ".join(parts) + "]\nprefill: {}\ndecode: {}\n"


CASES: dict[str, Callable[[], bytes]] = {
    "over the size cap": lambda: (GOOD + "# " + "x" * MAX_FILE_BYTES + "\n").encode(),
    "binary": lambda: b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe\xfd",
    "latin-1": lambda: "model: caf\xe9\nprefill: {}\ndecode: {}\n".encode("latin-1"),
    "NUL byte": lambda: b"model: m\x00\nprefill: {}\ndecode: {}\n",
    "alias bomb": lambda: _bomb().encode(),
    "one alias": lambda: b"model: &m m\nprefill: {}\ndecode: {}\nrouter: {policy: *m}\n",
    "merge key": lambda: b"prefill: &p {count: 1}\ndecode: {<<: *p}\nmodel: m\n",
    "duplicate key": lambda: (GOOD + "model: other\n").encode(),
    "nested duplicate key": lambda: b"model: m\nprefill: {tp: 2, tp: 4}\ndecode: {}\n",
    "huge count": lambda: b"model: m\nprefill: {count: 100000000}\ndecode: {}\n",
    "huge tp": lambda: b"model: m\nprefill: {tp: 100000000}\ndecode: {}\n",
    "huge nnodes": lambda: b"model: m\nprefill: {nnodes: 100000000}\ndecode: {}\n",
    "too many nodes in all": lambda: b"model: m\nprefill: {count: 200, nnodes: 200}\n"
                                     b"decode: {}\n",
    "huge gpus_per_node": lambda: (GOOD + "kubernetes: {gpus_per_node: 100000000}\n").encode(),
    "huge max_total_tokens": lambda: (GOOD + "max_total_tokens: " + "9" * 4000).encode(),
    "integer too long to parse": lambda: ("model: m\nprefill: {count: " + "9" * 5000 +
                                          "}\ndecode: {}\n").encode(),
    "deep nesting": lambda: ("model: " + "[" * 50000 + "]" * 50000 + "\n").encode(),
    "too many args": lambda: (GOOD.replace("{count: 1}\nd", "{args: [" + ", ".join(
        ["--a"] * 5000) + "]}\nd", 1)).encode(),
    "long value": lambda: ("model: " + "m" * 100000 + "\nprefill: {}\ndecode: {}\n").encode(),
    "long unknown key": lambda: (GOOD + "k" * 100000 + ": 1\n").encode(),
    "key with a line break": lambda: (GOOD + '"bad\\nkey": 1\n').encode(),
    "value repr too long": lambda: ("model: [" + ", ".join(["x" * 50] * 2000) + "]\n"
                                    "prefill: {}\ndecode: {}\n").encode(),
    "long policy": lambda: (GOOD + "router: {policy: " + "p" * 100000 + "}\n").encode(),
    "long tag": lambda: ("model: !" + "t" * 100000 + " m\nprefill: {}\ndecode: {}\n").encode(),
    "name with a leading dash": lambda: (GOOD + "kubernetes: {name: -omni}\n").encode(),
    "name with a leading digit": lambda: (GOOD + "kubernetes: {name: 1omni}\n").encode(),
    "name too long": lambda: (GOOD + "kubernetes: {name: " + "a" * 60 + "}\n").encode(),
    "name not ASCII": lambda: (GOOD + "kubernetes: {name: ömni}\n").encode(),
    "namespace upper case": lambda: (GOOD + "kubernetes: {namespace: Bad_NS}\n").encode(),
    "namespace too long": lambda: (GOOD + "kubernetes: {namespace: " + "a" * 64 + "}\n").encode(),
    "namespace with a dot": lambda: (GOOD + "kubernetes: {namespace: a.b}\n").encode(),
    "image with a space": lambda: (GOOD + "kubernetes: {image: 'img:1 --privileged'}\n").encode(),
    "empty model": lambda: b"model: ''\nprefill: {}\ndecode: {}\n",
}


def _write(tmp_path: Path, content: bytes) -> Path:
    path = tmp_path / "hostile.yaml"
    path.write_bytes(content)
    return path


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_hostile_file_gets_one_short_line_and_status_2(case: str, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    path = _write(tmp_path, CASES[case]())
    for extra in (["--check"], ["--render", "commands"], ["--render", "lws"]):
        start = time.monotonic()
        status = main(["deploy", str(path), *extra])
        elapsed = time.monotonic() - start
        out, err = capsys.readouterr()
        assert status == 2, (case, extra, out[:200], err[:200])
        assert out == ""
        lines = err.splitlines()
        assert len(lines) == 1 and err.endswith("\n"), (case, err[:300])
        assert lines[0].startswith(f"omniinfer deploy: error: {path}: "), lines[0][:300]
        assert len(lines[0]) <= len(str(path)) + 260, (case, len(lines[0]), lines[0][:300])
        assert lines[0].isprintable(), lines[0][:300]
        assert elapsed < 10, (case, elapsed)


def test_the_size_cap_is_inclusive_and_the_message_names_it(tmp_path: Path) -> None:
    assert getattr(spec, "MAX_FILE_BYTES", None) == MAX_FILE_BYTES
    at_cap = GOOD + "#" * (MAX_FILE_BYTES - len(GOOD) - 1) + "\n"
    assert len(at_cap.encode()) == MAX_FILE_BYTES
    load(_write(tmp_path, at_cap.encode()))
    with pytest.raises(DeployError, match=r"larger than 1 MiB"):
        load(_write(tmp_path, (at_cap + "#").encode()))


def test_dev_zero_is_refused_without_reading_it_all() -> None:
    """``/dev/zero`` (endless) under a 1 GiB address-space limit: one line, status 2."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    script = ("import argparse, sys\nfrom omniinfer.deploy import cli\n"
              "p = argparse.ArgumentParser(); cli.add_parser(p.add_subparsers())\n"
              "a = p.parse_args(sys.argv[1:]); sys.exit(a.func(a))\n")
    done = subprocess.run([sys.executable, "-c", script, "deploy", "/dev/zero", "--check"],
                          capture_output=True, text=True, timeout=60, preexec_fn=limit)
    assert done.returncode == 2, done.stderr[-500:]
    assert done.stderr.splitlines() == [
        "omniinfer deploy: error: /dev/zero: larger than 1 MiB (the most a deployment file "
        "may hold)"]


def test_an_alias_bomb_is_refused_fast_with_a_short_message(tmp_path: Path) -> None:
    path = _write(tmp_path, _bomb(levels=7).encode())  # ten million leaves
    start = time.monotonic()
    with pytest.raises(DeployError) as err:
        load(path)
    assert time.monotonic() - start < 2
    assert len(str(err.value)) < 200 and "alias" in str(err.value), str(err.value)[:300]


@pytest.mark.parametrize(("content", "message"), [
    (GOOD + "model: other\n", "hostile.yaml: not valid YAML (line 4): duplicate key 'model'"),
    ("model: m\nprefill:\n  tp: 2\n  tp: 4\ndecode: {}\n",
     "not valid YAML (line 4): duplicate key 'tp'"),
    ("model: &m m\nprefill: {}\ndecode: {}\n",
     "not valid YAML (line 1): anchors and aliases (& and *) are not allowed"),
    ("model: m\nprefill: {}\ndecode: {<<: {count: 2}}\n",
     "not valid YAML (line 3): merge keys (<<) are not allowed"),
    ("model: m\nprefill: {}\ndecode: {}\n---\nmodel: x\n",
     "not valid YAML (line 4): expected a single document in the stream, but found another"),
    ("model: " + "[" * 40 + "]" * 40 + "\n", "not valid YAML (line 1): nested deeper than 16"),
    ("model: m\nprefill: {count: " + "9" * 5000 + "}\n",
     "not valid YAML (line 2): an integer of more than 64 characters"),
    ('model: m\nprefill: {args: [--a, "1\\n2"]}\n', "prefill.args[1]: a control character"),
    ("\xff", "not UTF-8 text"),
    ("model: m\x00\n", "binary content"),
    ("model: m\nprefill: {count: 100000000}\ndecode: {}\n",
     "prefill.count: must be <= 256, got 100000000"),
    ("model: m\nprefill: {tp: 8192}\ndecode: {}\n", "prefill.tp: must be <= 4096"),
    ("model: m\nprefill: {count: 200, nnodes: 200}\ndecode: {}\n",
     "prefill and decode: 40001 server nodes in all (count x nnodes), more than the 1024 a "
     "deployment may have"),
    (GOOD + "kubernetes: {name: 1omni}\n", "kubernetes.name: must be a Kubernetes name"),
    (GOOD + "kubernetes: {namespace: Bad_NS}\n",
     "kubernetes.namespace: must be a Kubernetes namespace"),
    ("model: [" + ", ".join(["x" * 50] * 2000) + "]\nprefill: {}\ndecode: {}\n",
     "model: must be str, got ['xxxxxxxx"),
])
def test_each_refusal_says_what_is_wrong(tmp_path: Path, content: str, message: str) -> None:
    raw = content.encode("latin-1") if content == "\xff" else content.encode()
    with pytest.raises(DeployError) as err:
        load(_write(tmp_path, raw))
    assert message in str(err.value), str(err.value)[:300]
    assert len(str(err.value)) <= len(str(tmp_path)) + 260


def test_values_in_messages_are_cut_to_80_characters(tmp_path: Path) -> None:
    with pytest.raises(DeployError) as err:
        load(_write(tmp_path, ("model: m\nprefill: {}\ndecode: {}\n"
                               "router: {policy: " + "p" * 1000 + "}\n").encode()))
    shown = str(err.value).split("unknown policy ", 1)[1].split(" (one of")[0]
    assert len(shown) == 80 and shown.endswith("..."), shown


def test_every_limit_is_reachable_and_the_example_still_loads(tmp_path: Path) -> None:
    """The bounds refuse only what is past them: the shipped file and a file at every
    maximum load, and the largest render stays small."""
    from omniinfer.deploy import render

    load(EXAMPLE)
    data = {"model": "m", "device": "gpu", "prefill": {"count": 256, "tp": 4096, "ep": 4096,
                                                        "nnodes": 3},
            "decode": {"count": 1, "nnodes": 256, "tp": 4096},
            "max_total_tokens": 2**31 - 1,
            "kubernetes": {"name": "a" * 40, "namespace": "n" * 63, "gpus_per_node": 64}}
    dep = load(_write(tmp_path, yaml.safe_dump(data).encode()))
    assert len(render.commands(dep)) < 16 * 2**20
