"""The upstream router (pip sglang-router 0.3.2) routes PD traffic to emulated workers without errors."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest
from emu_helpers import Emulator, request, sse_events, start_emulator, wait_http

from omniinfer.launch import free_port

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("sglang_router") is None, reason="sglang-router is not installed"
)


@pytest.fixture(scope="module")
def pd_router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("pd")
    workers: list[Emulator] = []
    router = None
    try:
        prefills = [start_emulator(tmp, "--disaggregation-mode", "prefill") for _ in range(2)]
        decode = start_emulator(tmp, "--disaggregation-mode", "decode")
        workers = [*prefills, decode]
        port = free_port()
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
               "--host", "127.0.0.1", "--port", str(port),
               "--prefill-policy", "cache_aware", "--decode-policy", "round_robin", "--log-level", "warn"]
        for p in prefills:
            cmd += ["--prefill", p.url, str(p.bootstrap_port)]
        cmd += ["--decode", decode.url]
        log = tmp / "router.log"
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        router = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                                  start_new_session=True, env=env)
        wait_http(f"http://127.0.0.1:{port}/health", router, log, timeout=90)
        # the router activates workers in the background: wait until a request goes through
        for _ in range(100):
            status, _ = request(f"http://127.0.0.1:{port}/generate", "POST",
                                {"text": "warm up", "sampling_params": {"max_new_tokens": 1}})
            if status == 200:
                break
            import time

            time.sleep(0.3)
        yield f"http://127.0.0.1:{port}"
    finally:
        if router is not None and router.poll() is None:
            os.killpg(router.pid, signal.SIGTERM)
            router.wait(timeout=20)
        for w in workers:
            w.stop()


def test_router_pd_generate(pd_router: str) -> None:
    status, text = request(f"{pd_router}/generate", "POST",
                           {"text": "hello pd", "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}})
    assert status == 200, text
    body = json.loads(text)
    assert body["meta_info"]["completion_tokens"] == 4
    assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 4}


def test_router_pd_generate_stream(pd_router: str) -> None:
    status, text = request(f"{pd_router}/generate", "POST",
                           {"text": "hello stream", "sampling_params": {"max_new_tokens": 5}, "stream": True})
    assert status == 200, text
    events = sse_events(text)
    assert events[-1] == "[DONE]"
    counts = [json.loads(e)["meta_info"]["completion_tokens"] for e in events[:-1]]
    assert counts == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("stream", [False, True])
def test_router_pd_chat(pd_router: str, stream: bool) -> None:
    body = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": stream}
    status, text = request(f"{pd_router}/v1/chat/completions", "POST", body)
    assert status == 200, text
    if stream:
        events = sse_events(text)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    else:
        assert json.loads(text)["usage"]["completion_tokens"] == 4


def test_router_pd_many_concurrent(pd_router: str) -> None:
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> int:
        body = {"text": f"request {i} " * 20, "sampling_params": {"max_new_tokens": 8}, "stream": i % 2 == 0}
        return request(f"{pd_router}/generate", "POST", body)[0]

    with ThreadPoolExecutor(32) as pool:
        statuses = list(pool.map(one, range(64)))
    assert statuses == [200] * 64
