"""Faults in regular mode with emulated workers (EmulatedPDWorker in regular role): a worker
killed mid-stream, 5xx retries, health ejection and re-admission, an overload burst, and a
property-based fuzz of the HTTP API."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from proxy_helpers import EmulatedWorkerProcess, get, post, sse_events, wait_until

from omniinfer.proxy.process import RouterProcess
from omniinfer.proxy.workers import normalize_url

FAST_HEALTH = ["--health-check-interval-secs", "0.2", "--health-failure-threshold", "2",
               "--health-success-threshold", "1", "--retry-initial-backoff-ms", "1",
               "--cb-failure-threshold", "2", "--cb-timeout-duration-secs", "30"]


async def _stream(session: aiohttp.ClientSession, url: str, text: str, n: int) -> list:
    async with session.post(url + "/generate", json={
            "text": text, "stream": True, "sampling_params": {"max_new_tokens": n}}) as resp:
        assert resp.status == 200
        return sse_events((await resp.read()).decode())


def test_worker_killed_mid_stream_errors_only_its_clients(tmp_path: Path) -> None:
    log = tmp_path / "access.jsonl"
    with EmulatedWorkerProcess(token_delay=0.03) as a, \
            EmulatedWorkerProcess(token_delay=0.03) as b, \
            RouterProcess(["--worker-urls", a.url, b.url, "--policy", "round_robin",
                           "--access-log", str(log), *FAST_HEALTH], tmp_path / "r.log") as router:
        a.configure(die_after_tokens=5)

        async def run() -> list[list]:
            async with aiohttp.ClientSession() as session:
                first = await asyncio.gather(*(_stream(session, router.base_url, f"s{i}", 20)
                                               for i in range(8)))
                after = await asyncio.gather(*(_stream(session, router.base_url, f"t{i}", 5)
                                               for i in range(8)))
                return [*first, *after]

        results = asyncio.run(run())
    errored = [ev for ev in results if any(isinstance(e, dict) and "error" in e for e in ev)]
    clean = [ev for ev in results if ev not in errored]
    assert 1 <= len(errored) <= 4  # round robin put half of the first 8 on the dying worker
    for events in errored:
        errors = [e for e in events if isinstance(e, dict) and "error" in e]
        assert len(errors) == 1 and events[-1] == "[DONE]"
        assert "mid-stream" in errors[0]["error"]["message"]
    for events in clean:  # everybody else got the whole answer
        assert events[-1] == "[DONE]" and events[-2]["meta_info"]["finish_reason"] is not None
    assert len(clean) == 16 - len(errored)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert sum(1 for r in records if "error" in r) == len(errored)


def test_5xx_is_retried_and_breaker_opens(tmp_path: Path) -> None:
    with EmulatedWorkerProcess() as a, EmulatedWorkerProcess() as b, \
            RouterProcess(["--worker-urls", a.url, b.url, "--policy", "round_robin",
                           *FAST_HEALTH], tmp_path / "r.log") as router:
        a.configure(fail_status=503)
        for i in range(8):
            status, answer, _ = post(router.base_url + "/generate",
                                     {"text": f"x{i}", "stream": i % 2 == 1,
                                      "sampling_params": {"max_new_tokens": 2}})
            assert status == 200, answer
        workers = {w["url"]: w for w in get(router.base_url + "/list_workers")[1]["workers"]}
        assert workers[normalize_url(a.url)]["circuit"] == "open"
        assert len(a.log()["requests"]) == 2  # after two failures nothing more was sent to it
        status, metrics = get(router.base_url + "/metrics")
        assert 'omniproxy_retries_total{cause="status",role="regular"} 2.0' in metrics


def test_health_ejects_and_readmits(tmp_path: Path) -> None:
    with EmulatedWorkerProcess() as a, EmulatedWorkerProcess() as b, \
            RouterProcess(["--worker-urls", a.url, b.url, *FAST_HEALTH],
                          tmp_path / "r.log") as router:
        def healthy() -> dict:
            return {w["url"]: w["healthy"] for w in
                    get(router.base_url + "/list_workers")[1]["workers"]}

        port = a.port
        a.kill()
        assert wait_until(lambda: not healthy()[normalize_url(a.url)], timeout=5)
        for i in range(6):  # nobody notices
            assert post(router.base_url + "/generate", {"text": f"y{i}"})[0] == 200
        with EmulatedWorkerProcess(port=port):
            assert wait_until(lambda: healthy()[normalize_url(a.url)], timeout=5)
        b.kill()
        assert wait_until(lambda: get(router.base_url + "/health")[0] == 503, timeout=5)
        status, answer, headers = post(router.base_url + "/generate", {"text": "nobody"})
        assert status in (502, 503) and "error" in answer


def test_overload_burst_every_request_answered_or_503(tmp_path: Path) -> None:
    with EmulatedWorkerProcess(token_delay=0.05) as a, \
            RouterProcess(["--worker-urls", a.url, "--max-concurrent-requests", "4",
                           "--queue-size", "4", "--queue-timeout-secs", "1"],
                          tmp_path / "r.log") as router:
        async def burst() -> list[tuple[int, str | None]]:
            async def one(session: aiohttp.ClientSession, i: int) -> tuple[int, str | None]:
                async with session.post(router.base_url + "/generate", json={
                        "text": f"burst {i}", "stream": i % 2 == 0,
                        "sampling_params": {"max_new_tokens": 8}}) as resp:
                    await resp.read()
                    return resp.status, resp.headers.get("Retry-After")

            timeout = aiohttp.ClientTimeout(total=30)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                return await asyncio.gather(*(one(session, i) for i in range(80)))

        results = asyncio.run(burst())
        assert len(results) == 80
        statuses = [s for s, _ in results]
        assert set(statuses) <= {200, 503}
        assert statuses.count(200) >= 8 and statuses.count(503) >= 1
        assert all(r is not None and int(r) >= 1 for s, r in results if s == 503)
        assert get(router.base_url + "/health")[0] == 200
        info = get(router.base_url + "/list_workers")[1]
        assert info["admission"]["active"] == 0 and info["admission"]["queued"] == 0


@pytest.fixture(scope="module")
def fuzz_router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    tmp = tmp_path_factory.mktemp("fuzz")
    with EmulatedWorkerProcess(token_delay=0.0) as a, \
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
def test_fuzz_http_api_never_500(fuzz_router: RouterProcess, path: str, body: bytes) -> None:
    status, answer, _ = post(fuzz_router.base_url + path, None, raw=body, timeout=30)
    assert status < 500 or status == 503 and path in PATHS[:3], (status, answer)
    if status >= 400:
        assert isinstance(answer, dict) and "error" in answer


def test_fuzz_huge_body_and_router_still_alive(fuzz_router: RouterProcess) -> None:
    status, answer, _ = post(fuzz_router.base_url + "/generate", None,
                             raw=b'{"text": "' + b"a" * 2_000_000 + b'"}')
    assert status == 413 and "error" in answer
    assert get(fuzz_router.base_url + "/health")[0] == 200
    assert post(fuzz_router.base_url + "/generate", {"text": "still here"})[0] == 200
