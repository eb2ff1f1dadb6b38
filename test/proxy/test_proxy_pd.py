"""PD mode end to end: the router in front of emulated 2P1D workers (``omniinfer emulate-worker``).

The workers are the emulator (SGLang's endpoints and bodies; a decode worker waits for its
prefill's bootstrap room, like SGLang's), with its fault switches. The router is the real one,
as a subprocess.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from proxy_helpers import get, post, sse_events, wait_until

from omniinfer.emulator.process import EmulatorProcess
from omniinfer.proxy.process import RouterProcess
from omniinfer.proxy.request import PHASE_NAMES
from omniinfer.proxy.workers import normalize_url

MODEL = "SmolLM2-135M-Instruct"  # what the cpu-smollm2 profile serves


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("pd")
    workers = [EmulatorProcess(mode, log_path=tmp / f"{mode}{i}.log")
               for i, mode in enumerate(("prefill", "prefill", "decode"))]
    try:
        for w in workers:
            w.launch()
        for w in workers:
            w.wait_ready()
        p1, p2, d = workers
        args = ["--pd-disaggregation", *p1.router_args(), *p2.router_args(), *d.router_args(),
                "--prefill-policy", "cache_aware", "--decode-policy", "power_of_two",
                "--health-check-interval-secs", "0.5", "--access-log", str(tmp / "access.jsonl"),
                "--retry-initial-backoff-ms", "1"]
        with RouterProcess(args, tmp / "router.log") as router:
            yield {"router": router, "prefill": [p1, p2], "decode": d,
                   "access_log": tmp / "access.jsonl"}
    finally:
        for w in workers:
            w.stop()


@pytest.fixture(autouse=True)
def _reset(cluster: dict[str, Any]) -> Iterator[None]:
    yield
    for w in [*cluster["prefill"], cluster["decode"]]:
        w.clear_faults()


def _idle(cluster: dict[str, Any]) -> bool:
    """No worker holds a request (running, queued, waiting for KV) any more."""
    for w in [*cluster["prefill"], cluster["decode"]]:
        load = w.load()
        if load["num_running_reqs"] or load["num_waiting_reqs"] or \
                load["disaggregation"]["decode_prealloc_queue_reqs"]:
            return False
    return True


def _completion_tokens(answer: dict[str, Any]) -> int:
    return int(answer.get("meta_info", answer.get("usage", {})).get("completion_tokens", -1))


PATHS = ["/generate", "/v1/completions", "/v1/chat/completions"]


def _body(path: str, text: str, tokens: int = 4) -> dict[str, Any]:
    if path == "/generate":
        return {"text": text, "sampling_params": {"max_new_tokens": tokens}}
    if path == "/v1/completions":
        return {"prompt": text, "max_tokens": tokens, "model": "m"}
    return {"messages": [{"role": "user", "content": text}], "max_tokens": tokens, "model": "m"}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("stream", [False, True])
def test_pd_endpoints_send_bootstrap_fields_to_both(cluster: dict[str, Any], path: str,
                                                     stream: bool) -> None:
    router = cluster["router"]
    marker = f"hello pd {path} stream={stream}"  # finds this request in the workers' logs
    body = {**_body(path, marker), "stream": stream}
    status, answer, _ = post(router.base_url + path, body)
    assert status == 200, answer
    if stream:
        events = sse_events(answer)
        assert events[-1] == "[DONE]"
        chunks = [e for e in events[:-1] if isinstance(e, dict)]
        assert not any("error" in c for c in chunks)
        if path == "/generate":
            assert chunks[-1]["meta_info"]["completion_tokens"] == 4
            assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
        else:
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    else:
        assert _completion_tokens(answer) == 4
    decode_bodies = [r["body"] for r in cluster["decode"].received()["requests"]
                     if marker in json.dumps(r["body"])]
    assert len(decode_bodies) == 1, decode_bodies
    decode_body = decode_bodies[0]
    prefill_bodies = [r["body"] for p in cluster["prefill"] for r in p.received()["requests"]
                      if r["body"].get("rid") == decode_body["rid"]]
    assert len(prefill_bodies) == 1 and prefill_bodies[0] == decode_body  # same body to both
    assert decode_body["bootstrap_host"] == "127.0.0.1"
    assert isinstance(decode_body["bootstrap_room"], int) and decode_body["bootstrap_room"] >= 0
    assert decode_body["bootstrap_port"] in {p.bootstrap_port for p in cluster["prefill"]}
    for key, value in body.items():
        assert decode_body[key] == value


def test_pd_decode_stream_does_not_wait_for_prefill_body(cluster: dict[str, Any]) -> None:
    for p in cluster["prefill"]:
        p.set_faults(first_byte_delay_s=3.0)  # KV is ready at once, the answer comes late
    start = time.perf_counter()
    status, answer, _ = post(cluster["router"].base_url + "/generate",
                             {"text": "late prefill", "stream": True,
                              "sampling_params": {"max_new_tokens": 3}})
    elapsed = time.perf_counter() - start
    assert status == 200 and sse_events(answer)[-1] == "[DONE]"
    assert sse_events(answer)[-2]["meta_info"]["completion_tokens"] == 3
    assert elapsed < 2.0, f"the decode stream waited for the prefill answer ({elapsed:.2f} s)"
    start = time.perf_counter()
    status, answer, _ = post(cluster["router"].base_url + "/generate",
                             {"text": "late prefill 2", "sampling_params": {"max_new_tokens": 3}})
    elapsed = time.perf_counter() - start
    assert status == 200 and _completion_tokens(answer) == 3
    assert elapsed < 2.0, f"the decode answer waited for the prefill answer ({elapsed:.2f} s)"


def test_pd_prefill_failure_aborts_decode_and_gives_one_error(cluster: dict[str, Any]) -> None:
    for p in cluster["prefill"]:
        p.set_faults(fail_status=500)
    status, answer, _ = post(cluster["router"].base_url + "/generate",
                             {"text": "doomed", "sampling_params": {"max_new_tokens": 4}},
                             timeout=20)
    assert status == 502, answer
    assert "prefill failed" in answer["error"]["message"]
    decode = cluster["decode"]
    doomed = [r["body"]["rid"] for r in decode.received()["requests"] if r["body"].get("text") == "doomed"]
    assert doomed and set(doomed) <= set(decode.aborted_rids())  # every attempt's decode aborted
    assert wait_until(lambda: _idle(cluster))  # and nothing is left waiting for its KV


def test_pd_prefill_failure_on_one_worker_is_retried_on_the_other(cluster: dict[str, Any]) -> None:
    bad, good = cluster["prefill"]
    bad.set_faults(fail_status=500)
    answers = [post(cluster["router"].base_url + "/generate",
                    {"text": f"retry me {i}", "sampling_params": {"max_new_tokens": 2}})
               for i in range(6)]
    assert [(status, _completion_tokens(a)) for status, a, _ in answers] == [(200, 2)] * 6, answers
    failed = [r["body"]["rid"] for r in bad.received()["requests"]
              if str(r["body"].get("text")).startswith("retry me")]
    assert set(failed) <= set(cluster["decode"].aborted_rids())  # their decode halves ended
    assert wait_until(lambda: _idle(cluster))


def test_pd_client_disconnect_aborts_both(cluster: dict[str, Any]) -> None:
    for p in cluster["prefill"]:
        p.set_faults(hang_after_tokens=0)  # the prefill never finishes

    async def walk_away() -> None:
        async with aiohttp.ClientSession() as session:
            with pytest.raises(asyncio.TimeoutError):
                await session.post(cluster["router"].base_url + "/generate",
                                   json={"text": "impatient", "sampling_params": {
                                       "max_new_tokens": 4}},
                                   timeout=aiohttp.ClientTimeout(total=0.5))

    asyncio.run(walk_away())
    decode = cluster["decode"]

    def aborted_both() -> bool:
        rids = [r["body"]["rid"] for r in decode.received()["requests"]
                if r["body"].get("text") == "impatient"]
        prefill_aborts = [a for p in cluster["prefill"] for a in p.aborted_rids()]
        return bool(rids) and rids[0] in decode.aborted_rids() and rids[0] in prefill_aborts

    assert wait_until(aborted_both, timeout=5.0)
    assert wait_until(lambda: _idle(cluster))


def test_pd_metrics_and_access_log(cluster: dict[str, Any]) -> None:
    router = cluster["router"]
    post(router.base_url + "/generate", {"text": "metrics please", "stream": True,
                                         "sampling_params": {"max_new_tokens": 3}})
    status, text = get(router.base_url + "/metrics")
    assert status == 200
    for phase in PHASE_NAMES:  # every phase of a PD request (test_proxy_pd_lifecycle: in order)
        assert f'omniproxy_phase_duration_seconds_count{{phase="{phase}"}}' in text
    assert 'omniproxy_routing_decisions_total{policy="cache_aware"' in text
    assert 'policy="power_of_two",reason=' in text
    assert "omniproxy_ttft_seconds_count" in text and "omniproxy_worker_inflight_tokens" in text

    def logged() -> dict[str, Any] | None:
        """The record of the streamed request; the log is flushed on a write a second after the
        last flush, so each poll answers one more small request."""
        post(router.base_url + "/generate", {"text": "flush", "sampling_params": {"max_new_tokens": 1}})
        path = cluster["access_log"]
        lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        return next((r for r in lines if r.get("stream") and r["status"] == 200), None)

    assert wait_until(lambda: logged() is not None, timeout=10.0, step=0.2)
    record = logged()
    assert record is not None
    assert set(record["phases"]) == set(PHASE_NAMES)
    times = [record["phases"][name] for name in PHASE_NAMES]
    assert times == sorted(times), record
    assert {d["role"] for d in record["decisions"]} == {"prefill", "decode"}
    assert record["ttft"] > 0 and record["bootstrap_room"] >= 0


def test_pd_server_info_models_flush_and_worker_admin(cluster: dict[str, Any], tmp_path: Path) -> None:
    base = cluster["router"].base_url
    status, info = get(base + "/server_info")
    assert status == 200 and info["omniproxy"]["mode"] == "pd"
    assert get(base + "/v1/models")[1]["data"][0]["id"] == MODEL
    assert wait_until(lambda: _idle(cluster))
    status, flushed, _ = post(base + "/flush_cache", {})
    assert status == 200 and flushed["success"] and len(flushed["workers"]) == 3
    with EmulatorProcess("prefill", log_path=tmp_path / "extra.log") as extra:
        status, _, _ = post(base + f"/add_worker?url={extra.url}&worker_type=prefill"
                                   f"&bootstrap_port={extra.bootstrap_port}", None, raw=b"")
        assert status == 200
        urls = {w["url"] for w in get(base + "/list_workers")[1]["workers"]}
        assert normalize_url(extra.url) in urls
        assert post(base + "/add_worker", {"url": extra.url})[0] == 400  # PD needs a role
        assert post(base + "/remove_worker", {"url": extra.url})[0] == 200
        assert post(base + "/remove_worker", {"url": extra.url})[0] == 404


def test_bench_through_pd_router_loses_no_request(cluster: dict, tmp_path: Path) -> None:
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, "-m", "omniinfer", "bench", "--base-url", cluster["router"].base_url,
         "--num-requests", "48", "--concurrency", "12", "--input-len", "32",
         "--output-len", "8", "--no-progress", "--output-dir", str(out)],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] == 48 and summary["errors"] == 0
