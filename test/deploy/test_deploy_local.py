"""``omniinfer deploy FILE`` on this machine: the patterned 1P1D system with OmniProxy (oas)
from one file, serving through the router, and every process gone after Ctrl-C."""

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
MODEL = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"
PATTERN = ROOT / "python" / "omniinfer" / "attn" / "patterns" / "smollm2-135m.json"


def _closed(url: str) -> bool:
    host, port = url.rsplit("/", 1)[1].split(":")
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex((host, int(port))) != 0


def test_deploy_starts_the_system_serves_and_stops_everything(tmp_path: Path) -> None:
    port = free_port()
    spec = tmp_path / "system.yaml"
    spec.write_text(
        f"model: {MODEL}\nmax_total_tokens: 8192\n"
        f"prefill: {{count: 1, omni_attn_pattern: {PATTERN}}}\n"
        f"decode: {{count: 1, omni_attn_pattern: {PATTERN}}}\n"
        f"router: {{port: {port}, policy: oas}}\n")
    proc = subprocess.Popen([sys.executable, "-m", "omniinfer", "deploy", str(spec),
                             "--log-dir", str(tmp_path / "logs")],
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
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0
        assert all(_closed(url) for url in urls.values()), urls
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
