"""Faults in regular mode with emulated workers (``omniinfer emulate-worker`` with its fault
switches): a worker that crashes mid-stream, 5xx retries, health ejection and re-admission, an
overload burst, and a property-based fuzz of the HTTP API."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from proxy_helpers import get, post, sse_events, wait_until

from omniinfer.emulator.process import EmulatorProcess
from omniinfer.emulator.server import EXIT_STATUS
from omniinfer.proxy.process import RouterProcess
from omniinfer.proxy.workers import normalize_url

FAST_HEALTH = ["--health-check-interval-secs", "0.2", "--health-failure-threshold", "2",
               "--health-success-threshold", "1", "--retry-initial-backoff-ms", "1",
               "--cb-failure-threshold", "2", "--cb-timeout-duration-secs", "30"]


def _counters_at_zero(router: RouterProcess) -> bool:
    info = get(router.base_url + "/list_workers")[1]
    busy = [(w["inflight_requests"], w["inflight_tokens"]) for w in info["workers"]]
    return all(b == (0, 0) for b in busy) and info["admission"]["active"] == 0 \
        and info["admission"]["queued"] == 0


async def _stream(session: aiohttp.ClientSession, url: str, rid: str, n: int) -> list[Any]:
    async with session.post(url + "/generate", json={
            "text": f"stream {rid}", "rid": rid, "stream": True,
            "sampling_params": {"max_new_tokens": n}}) as resp:
        assert resp.status == 200
        return sse_events((await resp.read()).decode())


def test_worker_crashing_mid_stream_errors_only_its_clients(tmp_path: Path) -> None:
    log = tmp_path / "access.jsonl"
    with EmulatorProcess(time_scale=0.05, log_path=tmp_path / "a.log") as a, \
            EmulatorProcess(time_scale=0.05, log_path=tmp_path / "b.log") as b, \
            RouterProcess(["--worker-urls", a.url, b.url, "--policy", "round_robin",
                           "--access-log", str(log), *FAST_HEALTH], tmp_path / "r.log") as router:
        a.set_faults(exit_after_tokens=5)  # the process dies once a stream has sent 5 tokens

        async def run() -> dict[str, list[Any]]:
            async with aiohttp.ClientSession() as session:
                first = [f"s{i}" for i in range(8)]
                got = await asyncio.gather(*(_stream(session, router.base_url, r, 20) for r in first))
                after = [f"t{i}" for i in range(8)]
                got += await asyncio.gather(*(_stream(session, router.base_url, r, 5) for r in after))
                return dict(zip(first + after, got, strict=True))

        results = asyncio.run(run())
        assert a.process is not None and a.process.wait(timeout=10) == EXIT_STATUS  # it crashed
        assert wait_until(lambda: _counters_at_zero(router), 10)
    records = {r["client_rid"]: r for r in map(json.loads, log.read_text().splitlines())}
    on_a = {rid for rid, r in records.items()
            if normalize_url(a.url) in [d["worker"] for d in r["decisions"]]}
    first_on_a = {rid for rid in on_a if rid.startswith("s")}
    assert len(first_on_a) == 4  # round robin: half of the first wave
    errored = {rid for rid, events in results.items()
               if any(isinstance(e, dict) and "error" in e for e in events)}
    assert errored and errored <= first_on_a  # only streams the crashed worker had begun
    for rid, events in results.items():
        assert events[-1] == "[DONE]", rid
        tokens = [e["meta_info"]["completion_tokens"] for e in events[:-1] if "meta_info" in e]
        if rid in errored:  # some tokens, then one error event saying the output is incomplete
            error = events[-2]["error"]
            assert "mid-stream" in error["message"] and "incomplete" in error["message"]
            assert error["code"] == 502 and 1 <= tokens[-1] < 20
            assert "error" in records[rid]
        else:  # everybody else got the whole answer, also those a had not begun (retried on b)
            assert tokens[-1] == (20 if rid.startswith("s") else 5), rid
            assert events[-2]["meta_info"]["finish_reason"]["type"] == "length"
            assert "error" not in records[rid], rid


def test_5xx_is_retried_and_breaker_opens(tmp_path: Path) -> None:
    with EmulatorProcess(log_path=tmp_path / "a.log") as a, \
            EmulatorProcess(log_path=tmp_path / "b.log") as b, \
            RouterProcess(["--worker-urls", a.url, b.url, "--policy", "round_robin",
                           *FAST_HEALTH], tmp_path / "r.log") as router:
        a.set_faults(fail_status=503)
        for i in range(8):
            status, answer, _ = post(router.base_url + "/generate",
                                     {"text": f"x{i}", "stream": i % 2 == 1,
                                      "sampling_params": {"max_new_tokens": 2}})
            assert status == 200, answer
            final = sse_events(answer)[-2] if i % 2 else answer
            assert final["meta_info"]["completion_tokens"] == 2  # a whole answer, from b
        workers = {w["url"]: w for w in get(router.base_url + "/list_workers")[1]["workers"]}
        assert workers[normalize_url(a.url)]["circuit"] == "open"
        assert len(a.received()["requests"]) == 2  # after two failures nothing more was sent to it
        assert len(b.received()["requests"]) == 8  # its own six and the two retries
        status, metrics = get(router.base_url + "/metrics")
        assert 'omniproxy_retries_total{cause="status",role="regular"} 2.0' in metrics
        assert wait_until(lambda: _counters_at_zero(router), 10)


def test_health_ejects_and_readmits(tmp_path: Path) -> None:
    with EmulatorProcess(log_path=tmp_path / "a.log") as a, \
            EmulatorProcess(log_path=tmp_path / "b.log") as b, \
            RouterProcess(["--worker-urls", a.url, b.url, *FAST_HEALTH],
                          tmp_path / "r.log") as router:
        def healthy() -> dict[str, bool]:
            return {w["url"]: w["healthy"] for w in
                    get(router.base_url + "/list_workers")[1]["workers"]}

        a.kill()
        assert wait_until(lambda: not healthy()[normalize_url(a.url)], timeout=5)
        for i in range(6):  # nobody notices
            status, answer, _ = post(router.base_url + "/generate",
                                     {"text": f"y{i}", "sampling_params": {"max_new_tokens": 2}})
            assert status == 200 and answer["meta_info"]["completion_tokens"] == 2
        with EmulatorProcess(port=a.port, log_path=tmp_path / "a2.log"):
            assert wait_until(lambda: healthy()[normalize_url(a.url)], timeout=5)
        b.kill()
        assert wait_until(lambda: get(router.base_url + "/health")[0] == 503, timeout=5)
        status, answer, headers = post(router.base_url + "/generate", {"text": "nobody"})
        assert status in (502, 503) and "error" in answer
        assert wait_until(lambda: _counters_at_zero(router), 10)


def test_overload_burst_every_request_answered_or_503(tmp_path: Path) -> None:
    with EmulatorProcess(time_scale=0.25, log_path=tmp_path / "a.log") as a, \
            RouterProcess(["--worker-urls", a.url, "--max-concurrent-requests", "4",
                           "--queue-size", "4", "--queue-timeout-secs", "1"],
                          tmp_path / "r.log") as router:
        async def burst() -> list[tuple[int, str | None, bytes]]:
            async def one(session: aiohttp.ClientSession, i: int) -> tuple[int, str | None, bytes]:
                async with session.post(router.base_url + "/generate", json={
                        "text": f"burst {i}", "stream": i % 2 == 0,
                        "sampling_params": {"max_new_tokens": 8}}) as resp:
                    return resp.status, resp.headers.get("Retry-After"), await resp.read()

            timeout = aiohttp.ClientTimeout(total=30)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                return await asyncio.gather(*(one(session, i) for i in range(80)))

        results = asyncio.run(burst())
        assert len(results) == 80
        statuses = [s for s, _, _ in results]
        assert set(statuses) <= {200, 503}
        assert statuses.count(200) >= 8 and statuses.count(503) >= 1
        assert all(r is not None and int(r) >= 1 for s, r, _ in results if s == 503)
        for status, _, body in results:  # the admitted ones got their whole answer
            if status == 200:
                text = body.decode()
                final = sse_events(text)[-2] if text.startswith("data:") else json.loads(text)
                assert final["meta_info"]["completion_tokens"] == 8
        assert get(router.base_url + "/health")[0] == 200
        assert wait_until(lambda: _counters_at_zero(router), 10)


@pytest.fixture(scope="module")
def fuzz_router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    tmp = tmp_path_factory.mktemp("fuzz")
    with EmulatorProcess(time_scale=0, log_path=tmp / "a.log") as a, \
            RouterProcess(["--worker-urls", a.url, "--max-payload-size", "1000000"],
                          tmp / "r.log") as router:
        yield router


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=12)
FIELDS = ["text", "input_ids", "prompt", "messages", "stream", "sampling_params", "max_tokens",
          "rid", "n", "model", "return_logprob"]
bodies = st.one_of(
    json_values.map(lambda v: json.dumps(v).encode()),
    st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=5).map(
        lambda d: json.dumps(d).encode()),
    st.binary(max_size=200),
)
PATHS = ["/generate", "/v1/completions", "/v1/chat/completions", "/add_worker",
         "/remove_worker"]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(PATHS), body=bodies)
@example(path="/v1/completions", body=b'{"prompt": ""}')  # the worker's own 400, passed through
def test_fuzz_http_api_never_500(fuzz_router: RouterProcess, path: str, body: bytes) -> None:
    status, answer, _ = post(fuzz_router.base_url + path, None, raw=body, timeout=30)
    assert status < 500 or status == 503 and path in PATHS[:3], (status, answer)
    if status >= 400:  # the router's own error, or the worker's (OpenAI style) passed through
        assert isinstance(answer, dict) and ("error" in answer or answer.get("object") == "error")


def test_fuzz_huge_body_and_router_still_alive(fuzz_router: RouterProcess) -> None:
    status, answer, _ = post(fuzz_router.base_url + "/generate", None,
                             raw=b'{"text": "' + b"a" * 2_000_000 + b'"}')
    assert status == 413 and "error" in answer
    assert get(fuzz_router.base_url + "/health")[0] == 200
    assert post(fuzz_router.base_url + "/generate", {"text": "still here"})[0] == 200


def test_oas_closes_a_streamed_regular_prefill_at_its_first_event(tmp_path: Path) -> None:
    """Regular mode has no prefill event, so ``oas`` reads the first streamed event as the end
    of the prefill: while the answer is still streaming, the instance's clock holds nothing
    sent (before, it held the request until the last token, and learned decode as prefill)."""
    with EmulatorProcess(time_scale=1.0, log_path=tmp_path / "w.log") as w, \
            RouterProcess(["--worker-urls", w.url, "--policy", "oas"], tmp_path / "r.log") as r:
        async def run() -> tuple[dict, int]:
            body = {"text": "hello " * 50, "stream": True,
                    "sampling_params": {"max_new_tokens": 60, "ignore_eos": True}}
            async with aiohttp.ClientSession() as session:
                async with session.post(r.base_url + "/generate", json=body) as resp:
                    assert resp.status == 200
                    await resp.content.readline()  # the first event
                    async with session.get(r.base_url + "/server_info") as info:
                        state = (await info.json())["omniproxy"]["policy_state"]["regular"]
                    rest = await resp.read()
            return state, rest.count(b"data:")

        state, later_events = asyncio.run(run())
        clocks = state["instances"]
        assert list(clocks) == [normalize_url(w.url)]
        assert clocks[normalize_url(w.url)]["sent"] == 0
        assert later_events > 10  # the stream was still running when the clock was read
