"""PD mode end to end: the router in front of emulated 2P1D workers (EmulatedPDWorker).

Real SGLang PD does not run on a CPU, so the workers are the emulation in
proxy_emulated_worker.py (same endpoints and bodies; the decode worker waits for the prefill's
bootstrap room, like SGLang's). The router is the real one, as a subprocess.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from proxy_helpers import EmulatedWorkerProcess, get, post, sse_events, wait_until

from omniinfer.proxy.process import RouterProcess
from omniinfer.proxy.workers import normalize_url


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("pd")
    workers = [EmulatedWorkerProcess("prefill"), EmulatedWorkerProcess("prefill"),
               EmulatedWorkerProcess("decode")]
    try:
        for w in workers:
            w.start()
        p1, p2, d = workers
        args = ["--pd-disaggregation", "--prefill", p1.url, str(p1.port),
                "--prefill", p2.url, str(p2.port), "--decode", d.url,
                "--prefill-policy", "cache_aware", "--decode-policy", "power_of_two",
                "--health-check-interval-secs", "0.5", "--access-log", str(tmp / "access.jsonl"),
                "--retry-initial-backoff-ms", "1"]
        with RouterProcess(args, tmp / "router.log") as router:
            yield {"router": router, "prefill": [p1, p2], "decode": d,
                   "access_log": tmp / "access.jsonl"}
    finally:
        for w in workers:
            w.kill()


@pytest.fixture(autouse=True)
def _reset(cluster: dict) -> Iterator[None]:
    yield
    for w in [*cluster["prefill"], cluster["decode"]]:
        w.configure(prefill_fail=False, prefill_response_delay=0.0, prefill_delay=0.01,
                    token_delay=0.002, fail_status=0)


BODIES = {
    "/generate": {"text": "hello pd world", "sampling_params": {"max_new_tokens": 4}},
    "/v1/completions": {"prompt": "hello pd world", "max_tokens": 4, "model": "m"},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                             "model": "m"},
}


@pytest.mark.parametrize("path", list(BODIES))
@pytest.mark.parametrize("stream", [False, True])
def test_pd_endpoints_send_bootstrap_fields_to_both(cluster: dict, path: str,
                                                     stream: bool) -> None:
    router = cluster["router"]
    body = dict(BODIES[path], stream=stream)
    status, answer, _ = post(router.base_url + path, body)
    assert status == 200, answer
    if stream:
        events = sse_events(answer)
        assert events[-1] == "[DONE]" and len(events) == 5  # 4 tokens + [DONE]
        rid = events[0].get("meta_info", events[0]).get("id")
    else:
        rid = answer.get("meta_info", answer).get("id")
        text = answer.get("text") or answer["choices"][0].get("text") or \
            answer["choices"][0]["message"]["content"]
        assert text.strip() == "t1 t2 t3 t4"
    decode_body = next(r["body"] for r in cluster["decode"].log()["requests"]
                       if r["body"].get("rid") == rid)
    prefill_bodies = [r["body"] for p in cluster["prefill"] for r in p.log()["requests"]
                      if r["body"].get("rid") == rid]
    assert len(prefill_bodies) == 1 and prefill_bodies[0] == decode_body  # same body to both
    assert decode_body["bootstrap_host"] == "127.0.0.1"
    assert isinstance(decode_body["bootstrap_room"], int) and decode_body["bootstrap_room"] >= 0
    ports = {p.port for p in cluster["prefill"]}
    assert decode_body["bootstrap_port"] in ports
    for key, value in body.items():
        assert decode_body[key] == value


def test_pd_decode_stream_does_not_wait_for_prefill_body(cluster: dict) -> None:
    for p in cluster["prefill"]:
        p.configure(prefill_response_delay=3.0)  # KV is ready at once, the answer comes late
    start = time.perf_counter()
    status, answer, _ = post(cluster["router"].base_url + "/generate",
                             {"text": "late prefill", "stream": True,
                              "sampling_params": {"max_new_tokens": 3}})
    elapsed = time.perf_counter() - start
    assert status == 200 and sse_events(answer)[-1] == "[DONE]"
    assert elapsed < 2.0, f"the decode stream waited for the prefill answer ({elapsed:.2f} s)"
    status, answer, _ = post(cluster["router"].base_url + "/generate",
                             {"text": "late prefill 2", "sampling_params": {"max_new_tokens": 3}})
    assert status == 200 and time.perf_counter() - start < 4.0


def test_pd_prefill_failure_aborts_decode_and_gives_one_error(cluster: dict) -> None:
    for p in cluster["prefill"]:
        p.configure(prefill_fail=True)
    status, answer, _ = post(cluster["router"].base_url + "/generate",
                             {"text": "doomed", "sampling_params": {"max_new_tokens": 4}},
                             timeout=20)
    assert status == 502, answer
    assert "prefill failed" in answer["error"]["message"]
    decode_log = cluster["decode"].log()
    doomed = [r["body"]["rid"] for r in decode_log["requests"] if r["body"].get("text") == "doomed"]
    assert doomed and set(doomed) <= set(decode_log["aborts"])  # every attempt's decode aborted


def test_pd_prefill_failure_on_one_worker_is_retried_on_the_other(cluster: dict) -> None:
    bad, good = cluster["prefill"]
    bad.configure(prefill_fail=True)
    answers = [post(cluster["router"].base_url + "/generate",
                    {"text": f"retry me {i}", "sampling_params": {"max_new_tokens": 2}})
               for i in range(6)]
    assert all(status == 200 for status, _, _ in answers), answers
    assert wait_until(lambda: bool(cluster["decode"].log()["aborts"]))


def test_pd_client_disconnect_aborts_both(cluster: dict) -> None:
    for p in cluster["prefill"]:
        p.configure(prefill_delay=3.0)

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
        rids = [r["body"]["rid"] for r in decode.log()["requests"]
                if r["body"].get("text") == "impatient"]
        prefill_aborts = [a for p in cluster["prefill"] for a in p.log()["aborts"]]
        return bool(rids) and rids[0] in decode.log()["aborts"] and rids[0] in prefill_aborts

    assert wait_until(aborted_both, timeout=5.0)


def test_pd_metrics_and_access_log(cluster: dict) -> None:
    router = cluster["router"]
    post(router.base_url + "/generate", {"text": "metrics please", "stream": True,
                                         "sampling_params": {"max_new_tokens": 3}})
    status, text = get(router.base_url + "/metrics")
    assert status == 200
    for phase in ("tokenize", "apc_matching", "prefill_waiting", "prefill_scheduled",
                  "prefill_running", "decode_running"):
        assert f'omniproxy_phase_duration_seconds_count{{phase="{phase}"}}' in text
    assert 'omniproxy_routing_decisions_total{policy="cache_aware"' in text
    assert 'policy="power_of_two",reason=' in text
    assert "omniproxy_ttft_seconds_count" in text and "omniproxy_worker_inflight_tokens" in text
    assert wait_until(lambda: cluster["access_log"].exists() and
                      "metrics please" not in "" and cluster["access_log"].stat().st_size > 0,
                      timeout=5.0)
    time.sleep(1.2)  # the log is flushed at most every second: one more request flushes it
    post(router.base_url + "/generate", {"text": "flush", "sampling_params": {"max_new_tokens": 1}})
    lines = [json.loads(line) for line in cluster["access_log"].read_text().splitlines()]
    record = next(r for r in lines if r.get("stream") and r["status"] == 200)
    assert {"tokenize", "prefill_scheduled", "decode_running"} <= set(record["phases"])
    assert {d["role"] for d in record["decisions"]} == {"prefill", "decode"}
    assert record["ttft"] > 0 and record["bootstrap_room"] >= 0


def test_pd_server_info_models_flush_and_worker_admin(cluster: dict) -> None:
    base = cluster["router"].base_url
    status, info = get(base + "/server_info")
    assert status == 200 and info["omniproxy"]["mode"] == "pd"
    assert get(base + "/v1/models")[1]["data"][0]["id"] == "emulated-model"
    status, flushed, _ = post(base + "/flush_cache", {})
    assert status == 200 and flushed["success"] and len(flushed["workers"]) == 3
    with EmulatedWorkerProcess("prefill") as extra:
        status, _, _ = post(base + f"/add_worker?url={extra.url}&worker_type=prefill"
                                   f"&bootstrap_port={extra.port}", None, raw=b"")
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
