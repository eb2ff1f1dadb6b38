"""The upstream router (pip sglang-router 0.3.2) routes PD traffic to emulated workers without errors."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator

import pytest
from emu_helpers import request, sse_events, start_emulator

from omniinfer.emulator.process import EmulatorProcess
from omniinfer.testbed.pd_servers import sglang_router

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("sglang_router") is None, reason="sglang-router is not installed"
)


@pytest.fixture(scope="module")
def pd_router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("pd")
    workers: list[EmulatorProcess] = []
    try:
        workers += [start_emulator(tmp, mode="prefill") for _ in range(2)]
        workers.append(start_emulator(tmp, mode="decode"))
        # ready once a request went through: it activates its workers in the background
        with sglang_router(workers, tmp / "router.log", "cache_aware", "round_robin") as router:  # type: ignore[arg-type]
            yield router.base_url
    finally:
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
