"""``oas`` end to end: OmniProxy in front of real ``omniinfer emulate-worker`` PD processes (2P1D)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from proxy_helpers import get, post, wait_until

from omniinfer.launch import free_port
from omniinfer.proxy.process import RouterProcess


def _emulator(log: Path, *args: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [sys.executable, "-m", "omniinfer", "emulate-worker", "--profile", "h100-llama3-8b",
           "--time-scale", "0.5", "--port", str(port), *args]
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def oas_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("oas")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        prefills = []
        for i in range(2):
            boot = free_port()
            proc, url = _emulator(tmp / f"p{i}.log", "--disaggregation-mode", "prefill",
                                  "--disaggregation-bootstrap-port", str(boot))
            procs.append(proc)
            prefills.append((url, boot))
        proc, decode = _emulator(tmp / "d.log", "--disaggregation-mode", "decode")
        procs.append(proc)
        for url in [u for u, _ in prefills] + [decode]:
            assert wait_until(lambda url=url: _up(url), timeout=60), url
        args = ["--pd-disaggregation", "--prefill-policy", "oas", "--decode-policy", "oas",
                "--access-log", str(tmp / "access.jsonl"), "--loads-poll-interval-secs", "0.2"]
        for url, boot in prefills:
            args += ["--prefill", url, str(boot)]
        args += ["--decode", decode]
        with RouterProcess(args, tmp / "router.log") as router:
            yield {"router": router, "access": tmp / "access.jsonl"}
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=10)


def _up(url: str) -> bool:
    try:
        return get(url + "/health", timeout=2)[0] == 200
    except OSError:
        return False


def test_oas_routes_concurrent_pd_requests_with_deferral_and_lpt(oas_cluster: dict) -> None:
    router = oas_cluster["router"]
    prefix = list(range(1000, 1512))  # 512 shared tokens = 32 APC blocks

    def one(i: int) -> tuple[int, dict]:
        ids = prefix + [5000 + i * 7 + k for k in range(40 + 60 * (i % 4))]
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4 + i % 3}}
        status, answer, _ = post(router.base_url + "/generate", body, timeout=60)
        return status, answer

    status, first = one(0)  # warms the prefix into one prefill worker
    assert status == 200 and first["meta_info"]["completion_tokens"] == 4
    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(one, range(1, 25)))
    assert [s for s, _ in answers] == [200] * 24
    assert all(a["meta_info"]["completion_tokens"] == 4 + i % 3
               for i, (_, a) in enumerate(answers, start=1))

    status, info = get(router.base_url + "/server_info")
    state = info["omniproxy"]["policy_state"]
    assert sum(state["prefill"]["released"].values()) == 25
    assert state["prefill"]["queued"] == 0
    assert any(i["samples"] > 0 for i in state["prefill"]["instances"].values())

    time.sleep(1.1)  # the access log is flushed at most every second, on the next request
    post(router.base_url + "/generate", {"text": "flush the log",
                                         "sampling_params": {"max_new_tokens": 1}})
    assert wait_until(lambda: oas_cluster["access"].exists()
                      and len(oas_cluster["access"].read_text().splitlines()) >= 25, timeout=10)
    rows = [json.loads(line) for line in oas_cluster["access"].read_text().splitlines()]
    decisions = [d for r in rows for d in r.get("decisions", [])]
    assert {d["reason"] for d in decisions if d["role"] == "prefill"} <= {"idle", "open", "starved", "overdue"}
    assert {d["reason"] for d in decisions if d["role"] == "decode"} == {"lpt"}
    # the router's APC prediction against what the prefill worker reports it reused
    pairs = [(r["decisions"][0]["cached_tokens"], r["reported_cached_tokens"]) for r in rows
             if "reported_cached_tokens" in r and r.get("decisions")]
    assert len(pairs) >= 24
    hits = [(p, r) for p, r in pairs if p > 0]
    assert len(hits) >= 12  # the shared prefix is found
    assert sum(1 for p, r in hits if abs(p - r) < 16) / len(hits) >= 0.9
