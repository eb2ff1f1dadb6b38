"""Hardening end to end: the router process in front of emulated workers. Each test names the
gap of #17 it closes and fails on the router before it (no flag, a 500, a leaked counter, an
abort that reached another client's request, a connection held forever)."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from proxy_helpers import get, post, sse_events, wait_until

from omniinfer.emulator.process import EmulatorProcess
from omniinfer.proxy.process import RouterProcess

FAST = ["--health-check-interval-secs", "0.2", "--retry-initial-backoff-ms", "1",
        "--cb-failure-threshold", "100"]


def _inflight(router: RouterProcess) -> list[int]:
    workers = get(router.base_url + "/list_workers")[1]["workers"]
    return [w["inflight_requests"] for w in workers] + [w["inflight_tokens"] for w in workers]


def _authorized(url: str, key: str | None, body: Any = None, path: str = "/generate",
                method: str = "POST") -> tuple[int, Any]:
    async def run() -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with aiohttp.ClientSession() as s, s.request(method, url + path, json=body,
                                                            headers=headers) as r:
            text = await r.text()
            try:
                return r.status, json.loads(text)
            except ValueError:
                return r.status, text
    return asyncio.run(run())


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("hard")
    with EmulatorProcess(time_scale=0.05) as a, EmulatorProcess(time_scale=0.05) as b:
        yield {"a": a, "b": b, "tmp": tmp}


@pytest.fixture(autouse=True)
def _reset(two: dict[str, Any]) -> Iterator[None]:
    yield
    for w in (two["a"], two["b"]):
        w.clear_faults()


def test_api_key_required_of_clients_and_sent_to_workers(two: dict[str, Any]) -> None:
    a = two["a"]
    with RouterProcess(["--worker-urls", a.url, "--api-key", "sk-1", "--control-plane-api-keys",
                        "ops:Ops:admin:sk-admin", "--control-plane-audit-enabled"],
                       two["tmp"] / "auth.log") as router:
        status, answer = _authorized(router.base_url, None, {"text": "hi"})
        assert status == 401 and answer["error"]["code"] == 401
        status, answer = _authorized(router.base_url, "sk-1", {"text": "key"})
        assert status == 200, answer
        seen = [r for r in a.received()["requests"] if r["body"].get("text") == "key"]
        assert seen and seen[-1]["authorization"] == "Bearer sk-1"
        assert _authorized(router.base_url, "sk-1", None, "/add_worker")[0] == 403
        assert _authorized(router.base_url, "sk-admin", None, "/flush_cache")[0] == 200
        assert get(router.base_url + "/health")[0] == 200
    log = (two["tmp"] / "auth.log").read_text()
    assert "control_plane_audit" in log and '"principal":"ops"' in log


def test_flush_cache_is_post_only_and_errors_are_json(two: dict[str, Any]) -> None:
    with RouterProcess(["--worker-urls", two["a"].url], two["tmp"] / "m.log") as router:
        status, answer = get(router.base_url + "/flush_cache")
        assert status == 405 and answer["error"]["code"] == 405
        status, answer = get(router.base_url + "/no/such/route")
        assert status == 404 and answer["error"]["code"] == 404
        status, answer = get(router.base_url + "/generate")
        assert status == 405 and isinstance(answer, dict)
        # a worker URL with a path would let /v1/models relay any page: refused, not added
        status, answer, _ = post(router.base_url + "/add_worker",
                                 {"url": two["b"].url + "/v1/models?x="})
        assert status == 400 and "path" in answer["error"]["message"]
        assert len(get(router.base_url + "/list_workers")[1]["workers"]) == 1


def test_bad_inputs_are_4xx_and_release_every_counter(two: dict[str, Any]) -> None:
    with RouterProcess(["--worker-urls", two["a"].url, "--policy", "cache_aware"],
                       two["tmp"] / "b.log") as router:
        deep = {"text": "x", "sampling_params": {"max_new_tokens": 2, "stop": [[]]}}
        nested: Any = []
        for _ in range(400):  # decodes, cannot be re-encoded: a 500 and a leak before
            nested = [nested]
        deep["extra"] = nested
        bodies = [json.dumps(deep).encode(), b'{"text": "x", "n": 1e999}',
                  b'{"text": {"a": 1}}', b'{"input_ids": [1, "2"]}', b'{"text": "x", "stream": 1}',
                  b'{"text": "x", "sampling_params": {"max_new_tokens": 99999999999999999999}}',
                  b"[1, 2]", b"\xff\xfe"]
        for raw in bodies:
            status, answer, _ = post(router.base_url + "/generate", None, raw=raw)
            assert 400 <= status < 500 or status == 200, (raw[:40], status, answer)
            assert isinstance(answer, dict)
            if status != 200:
                assert "error" in answer  # ours, or the worker's own 4xx
        assert _inflight(router) == [0, 0]
        assert post(router.base_url + "/generate", {"text": "fine"})[0] == 200
        two["a"].set_faults(fail_status=503)  # no worker can answer: still the input's 400
        for raw in (b'{"text": "x", "sampling_params": "many"}',
                    b'{"text": "x", "sampling_params": {"max_new_tokens": 1e300}}',
                    b'{"prompt": "x", "max_tokens": -1}'):
            path = "/v1/completions" if b"prompt" in raw else "/generate"
            assert post(router.base_url + path, None, raw=raw)[0] == 400, raw


def test_a_client_rid_cannot_abort_another_clients_request(two: dict[str, Any]) -> None:
    """SGLang aborts every rid that starts with the given one: "a" leaving used to abort "ab"."""
    a = two["a"]
    log = two["tmp"] / "rid.jsonl"
    with RouterProcess(["--worker-urls", a.url, "--access-log", str(log)],
                       two["tmp"] / "rid.log") as router:
        async def run() -> list[Any]:
            async with aiohttp.ClientSession() as s:
                victim = s.post(router.base_url + "/generate", json={
                    "text": "victim", "rid": "ab", "stream": True,
                    "sampling_params": {"max_new_tokens": 100}})
                before = len(a.aborted_rids())
                async with victim as resp:
                    assert resp.headers.get("X-Client-Rid") == "ab"
                    first = await resp.content.readline()
                    leaver = await s.post(router.base_url + "/generate", json={
                        "text": "leaver", "rid": "a", "stream": True,
                        "sampling_params": {"max_new_tokens": 100}})
                    await leaver.content.readline()
                    leaver.close()  # the client goes away: the router aborts its request
                    deadline = time.monotonic() + 10  # the loop must run to close the socket
                    while len(a.aborted_rids()) == before and time.monotonic() < deadline:
                        await asyncio.sleep(0.02)
                    assert len(a.aborted_rids()) > before
                    rest = await resp.read()
            return sse_events((first + rest).decode())

        events = asyncio.run(run())
    answer = [e for e in events if isinstance(e, dict)]
    assert events[-1] == "[DONE]" and answer[-1]["meta_info"]["completion_tokens"] == 100
    requests = a.received()["requests"]
    rids = {r["body"]["text"]: r["body"]["rid"] for r in requests
            if r["body"].get("text") in ("victim", "leaver")}
    assert rids["victim"] not in ("ab",) and len(rids["victim"]) == len(rids["leaver"]) == 24
    assert a.aborted_rids()[-1] == rids["leaver"]  # the abort names the router's rid
    records = [json.loads(line) for line in log.read_text().splitlines()]  # flushed at exit
    assert {r.get("client_rid") for r in records} >= {"a", "ab"}
    assert any(rids["leaver"] in r.get("worker_rids", []) for r in records)


def test_a_hung_worker_times_out_is_aborted_and_the_request_retried(two: dict[str, Any]) -> None:
    a, b = two["a"], two["b"]
    with RouterProcess(["--worker-urls", a.url, b.url, "--policy", "round_robin",
                        "--request-timeout-secs", "1.5", "--upstream-first-byte-timeout-secs",
                        "1", "--upstream-idle-timeout-secs", "1", *FAST],
                       two["tmp"] / "hang.log") as router:
        a.set_faults(hang_after_tokens=0)  # accepts and never answers
        for stream in (False, True, False, True):
            started = time.monotonic()
            status, answer, _ = post(router.base_url + "/generate", {
                "text": f"hang {stream}", "stream": stream,
                "sampling_params": {"max_new_tokens": 3}}, timeout=20)
            assert status == 200, answer
            assert time.monotonic() - started < 10
        hung = [r["body"]["rid"] for r in a.received()["requests"]
                if str(r["body"].get("text")).startswith("hang")]
        assert hung and wait_until(lambda: set(hung) <= set(a.aborted_rids()), 10)
        a.set_faults(hang_after_tokens=2)  # silent mid-stream: one error event
        b.set_faults(hang_after_tokens=2)
        status, text, _ = post(router.base_url + "/generate", {
            "text": "idle", "stream": True, "sampling_params": {"max_new_tokens": 5}}, timeout=20)
        events = sse_events(text) if isinstance(text, str) else []
        assert status == 200 and "error" in events[-2] and events[-1] == "[DONE]"
        assert wait_until(lambda: _inflight(router) == [0, 0, 0, 0], 10)


def _open(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.settimeout(10)
    return sock


def test_slow_heads_slow_bodies_and_too_many_connections(two: dict[str, Any]) -> None:
    with RouterProcess(["--worker-urls", two["a"].url, "--client-header-timeout-secs", "1",
                        "--client-body-timeout-secs", "1", "--max-connections", "3"],
                       two["tmp"] / "conn.log") as router:
        slow = _open(router.port)
        slow.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n")  # and never the rest
        assert slow.recv(100) == b""  # closed by the router, not held forever
        body = _open(router.port)
        body.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"text\": ")
        assert b" 408 " in body.recv(1000).split(b"\r\n")[0]
        slow.close()
        body.close()
        assert wait_until(lambda: get(router.base_url + "/list_workers")[1]["connections"]
                          ["open"] == 1, 10)  # only the asking connection itself
        held = [_open(router.port) for _ in range(3)]
        refused = _open(router.port)
        assert b" 503 " in refused.recv(1000)
        for s in (*held, refused):
            s.close()
        assert wait_until(lambda: get(router.base_url + "/health")[0] == 200, 10)


def test_a_worker_cookie_is_not_replayed_on_other_clients_requests() -> None:
    """A worker (or a balancer before it) that sets a cookie for one answer must not get it back
    on the requests the router sends for everyone else."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from omniinfer.proxy.config import RouterConfig
    from omniinfer.proxy.core import Router
    from omniinfer.proxy.worker_http import post as upstream_post
    from omniinfer.proxy.worker_http import read_all

    async def run() -> list[str | None]:
        seen: list[str | None] = []

        async def generate(request: web.Request) -> web.Response:
            seen.append(request.headers.get("Cookie"))
            answer = web.json_response({"text": "ok"})
            answer.set_cookie("session", f"user-{len(seen)}")
            return answer

        app = web.Application()
        app.router.add_post("/generate", generate)
        app.router.add_get("/health", lambda _: web.json_response({}))
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        # a host name, not an IP: aiohttp's default jar keeps cookies only from names
        router = Router(RouterConfig(worker_urls=[f"http://localhost:{server.port}"],
                                     disable_health_check=True, loads_poll_interval_secs=0))
        await router.start()
        try:
            worker = router.pool.all()[0]
            for _ in range(3):
                await read_all(await upstream_post(router, worker, "/generate", b"{}", False),
                               worker)
        finally:
            await router.close()
            await server.close()
        return seen

    assert asyncio.run(run()) == [None, None, None]
