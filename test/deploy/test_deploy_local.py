"""``omniinfer deploy FILE`` on this machine: the whole system from the shipped file
(``deploy/omni-1p1d-cpu.yaml``: SmolLM2-MoE 1P1D, two expert-parallel ranks per server, the
OmniAttn pattern and OmniPlacement on both, OmniProxy oas in front), serving through the
router, and every process gone after Ctrl-C."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from omniinfer.launch import free_port

pytestmark = pytest.mark.server
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "deploy" / "omni-1p1d-cpu.yaml"


def _closed(url: str) -> bool:
    host, port = url.rsplit("/", 1)[1].split(":")
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex((host, int(port))) != 0


def test_deploy_starts_the_system_serves_and_stops_everything(tmp_path: Path) -> None:
    port = free_port()
    import yaml

    data = yaml.safe_load(EXAMPLE.read_text())
    if not (ROOT / data["model"] / "config.json").is_file():
        pytest.fail(f"{data['model']} is missing: scripts/setup.sh builds it")
    data["router"]["port"] = port
    data["max_total_tokens"] = 8192
    spec = tmp_path / "system.yaml"
    spec.write_text(yaml.safe_dump(data))
    proc = subprocess.Popen([sys.executable, "-m", "omniinfer", "deploy", str(spec),
                             "--log-dir", str(tmp_path / "logs")], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "deploy exited early:\n" + "".join(lines)
            lines.append(line)
            if line.startswith("serving;"):
                break
        urls = {ln.split(":", 1)[0]: ln.split()[1] for ln in lines
                if ln.split(":", 1)[0] in ("prefill-0", "decode-0", "router")}
        assert urls["router"] == f"http://127.0.0.1:{port}"
        body = json.dumps({"text": "The capital of France is",
                           "sampling_params": {"max_new_tokens": 8, "temperature": 0}}).encode()
        request = urllib.request.Request(urls["router"] + "/generate", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as r:
            answer = json.loads(r.read())
        assert answer["meta_info"]["completion_tokens"] == 8
        with urllib.request.urlopen(urls["decode-0"] + "/omni/attn", timeout=10) as r:
            assert json.loads(r.read())["enabled"] is True
        for role in ("prefill-0", "decode-0"):  # the controller runs on both servers
            with urllib.request.urlopen(urls[role] + "/omni/placement", timeout=30) as r:
                status = json.loads(r.read())
            assert status["enabled"] is True and status["rank_count"] == 2, status
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0
        assert all(_closed(url) for url in urls.values()), urls
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
