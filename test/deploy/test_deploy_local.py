"""``omniinfer deploy FILE`` on this machine: the whole system from the shipped file
(``deploy/omni-1p1d-cpu.yaml``: SmolLM2-MoE 1P1D, two expert-parallel ranks per server, the
OmniAttn pattern and OmniPlacement on both, OmniProxy oas in front), serving through the
router, ``scripts/demo.sh --attach`` against it (an answer, the table and a line per
technique), and every process gone after Ctrl-C. One system start serves both: the demo starts
its deployment through the same ``deploy.local.Local`` as ``omniinfer deploy``."""

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

from omniinfer.child_process import free_port

pytestmark = pytest.mark.server
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "deploy" / "omni-1p1d-cpu.yaml"


def _closed(url: str) -> bool:
    host, port = url.rsplit("/", 1)[1].split(":")
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex((host, int(port))) != 0


def _check_demo(router_url: str, spec: Path, output: Path) -> None:
    """scripts/demo.sh attached to the running system: its answer, table and technique lines."""
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "demo.sh"), "--attach", router_url, "--deployment",
         str(spec), "--output-dir", str(output), "--num-requests", "4", "--concurrency", "2",
         "--input-len", "64", "--output-len", "16"],
        capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    answer = next(line for line in lines if line.startswith("[demo] A:"))
    assert "Paris" in answer
    assert "Requests per minute (QPM)" in result.stdout and "Completed / errors" in result.stdout
    assert "4 / 0" in result.stdout
    assert (output / "bench-summary.json").is_file()
    assert "OmniProxy (oas, PD mode) in front" in result.stdout
    assert "[demo] attached system left running" in result.stdout
    attn = next(line for line in lines if line.startswith("[demo] OmniAttn (decode server):"))
    assert "16 of 30 layers compressed" in attn
    sent = next(line for line in lines if line.startswith("[demo] OmniAttn (PD transfer):"))
    assert "% saved" in sent
    oas = next(line for line in lines if line.startswith("[demo] OmniProxy (OAS) decisions"))
    assert "prefill:" in oas and "decode:" in oas
    placement = next(line for line in lines
                     if line.startswith("[demo] OmniPlacement (decode server):"))
    assert int(placement.split(", ")[1].split()[0]) >= 1, placement  # migrations adopted


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
        _check_demo(urls["router"], spec, tmp_path / "demo")
        assert proc.poll() is None, "deploy stopped while the demo ran"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0
        assert all(_closed(url) for url in urls.values()), urls
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
