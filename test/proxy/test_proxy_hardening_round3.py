"""Hardening, round three: the router's control plane. Worker secrets nested in info answers,
endless control answers, absurd load figures and background loops that died silently, one
worker under several IPv4 spellings, and PD ``/health_generate`` with its prefill side down.
Each test fails on the router before the fix."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import re
import threading
import time
from importlib import resources
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from router_inproc import ScriptedWorker, router_for

from omniinfer.child_process import free_port
from omniinfer.emulator.process import EmulatorProcess
from omniinfer.proxy.config import RouterConfig
from omniinfer.proxy.control import supervise
from omniinfer.proxy.redact import MAX_DEPTH, redact
from omniinfer.proxy.server import HEALTH_GENERATE_TTL_S, open_router
from omniinfer.proxy.worker_api import flush_caches
from omniinfer.proxy.workers import (
    MAX_LOAD_COUNT,
    WorkerLoads,
    load_count,
    load_rate,
    normalize_url,
)

USER, ADMIN = "sk-user-3", "sk-admin-3"
KEYS = [f"u1:app:user:{USER}", f"a1:ops:admin:{ADMIN}"]
SECRETS = ("sk-worker-secret", "sk-admin-secret", "ssl-pw-secret", "hf-secret", "deep-secret")
FORBIDDEN = re.compile(r"key|secret|password|token", re.IGNORECASE)


def run(coro: Any, timeout: float = 120) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


def _server_info() -> dict[str, Any]:
    text = resources.files("omniinfer.emulator").joinpath(
        "sglang_0.5.23_server_info.json").read_text("utf-8")
    info = json.loads(text)
    for scope in (info, info["internal_states"][0]):
        scope.update(api_key=SECRETS[0], admin_api_key=SECRETS[1],
                     ssl_keyfile_password=SECRETS[2])
    info["internal_states"][0]["nested"] = [{"deeper": {"HF_TOKEN": SECRETS[3]}},
                                            [{"Client_Secret": SECRETS[4]}]]
    return info


def _forbidden_names(value: Any, path: str = "") -> list[str]:
    found = []
    if isinstance(value, dict):
        for k, v in value.items():
            if FORBIDDEN.search(k):
                found.append(f"{path}.{k}")
            found += _forbidden_names(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found += _forbidden_names(v, f"{path}[{i}]")
    return found


def _answer(data: Any) -> Any:
    async def route(request: web.Request) -> web.Response:
        return web.json_response(copy.deepcopy(data))
    return route


INFO_ROUTES = ("/server_info", "/get_server_info", "/model_info", "/get_model_info",
               "/v1/models", "/health_generate")


def test_a_user_key_reads_no_secret_named_field_at_any_depth() -> None:
    info = _server_info()
    model = {"model_path": "m", "tokenizer_path": "t", "api_key": SECRETS[0],
             "extra": [{"auth_token": SECRETS[3]}]}
    models = {"object": "list", "data": [{"id": "m", "owner_api_key": SECRETS[0]}]}
    routes = {"/server_info": _answer(info), "/get_server_info": _answer(info),
              "/model_info": _answer(model), "/get_model_info": _answer(model),
              "/v1/models": _answer(models),
              "/health_generate": _answer({"ok": True, "token": SECRETS[3]})}

    async def main() -> None:
        async with router_for([ScriptedWorker(routes)], control_plane_api_keys=KEYS) as (base, _):
            async with aiohttp.ClientSession() as s:
                for path in INFO_ROUTES:
                    async with s.get(base + path,
                                     headers={"Authorization": f"Bearer {USER}"}) as r:
                        raw = await r.read()
                        assert r.status == 200, (path, raw[:300])
                    assert not any(secret.encode() in raw for secret in SECRETS), path
                    assert _forbidden_names(json.loads(raw)) == [], path
                async with s.get(base + "/server_info",
                                 headers={"Authorization": f"Bearer {ADMIN}"}) as r:
                    raw = await r.read()
                    assert r.status == 200
                # an admin sees the token counts, never a secret
                assert not any(secret.encode() in raw for secret in SECRETS)
                admin_view = json.loads(raw)
                assert admin_view["internal_states"][0]["max_total_tokens"] == 16384
                assert "api_key" not in admin_view["internal_states"][0]
    run(main())


def _raw(body: bytes) -> Any:
    async def route(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json")
    return route


def test_a_deeply_nested_info_answer_is_no_500_and_no_stack_overflow() -> None:
    deep = b"[" * 1000 + b'"bottom"' + b"]" * 1000  # orjson parses 1024 levels, writes 255
    routes = {"/server_info": _raw(b'{"internal_states": [{"x": ' + deep + b', "api_key": 1}]}'),
              "/v1/models": _raw(b'{"data": ' + deep + b"}")}

    async def main() -> None:
        async with router_for([ScriptedWorker(routes)]) as (base, _):
            async with aiohttp.ClientSession() as s:
                for path in ("/server_info", "/v1/models"):
                    async with s.get(base + path) as r:
                        assert r.status == 200, (path, await r.text())
                        assert "api_key" not in await r.text()
    run(main())
    nested: Any = {}
    for _ in range(5000):  # deeper than Python's recursion limit: redact stops at MAX_DEPTH
        nested = {"a": nested}
    out, depth = redact(nested), 0
    while isinstance(out, dict):
        out, depth = out["a"], depth + 1
    assert depth == MAX_DEPTH


ENDLESS_CAP_MB = 192  # the fake worker's "endless" body stops here (a router before the fix
# read it all: keep the test's own memory sane)


async def _endless(request: web.Request) -> web.StreamResponse:
    out = web.StreamResponse(headers={"Content-Type": "application/json"})
    await out.prepare(request)
    chunk = b"[" + b" " * (1 << 20)
    try:
        for _ in range(ENDLESS_CAP_MB):
            await out.write(chunk)
    except (ConnectionResetError, RuntimeError):
        pass
    return out


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class PeakRss:
    """The process's highest RSS while it runs (sampled from a thread every 5 ms)."""

    def __init__(self) -> None:
        self.start = self.peak = _rss_mb()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss_mb())

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join()


def test_endless_control_answers_are_cut_at_the_cap() -> None:
    routes = {path: _endless for path in ("/v1/models", "/model_info", "/server_info",
                                          "/health_generate", "/v1/loads", "/flush_cache")}
    endless_health = ScriptedWorker({"/health": _endless})

    async def main() -> None:
        async with router_for([ScriptedWorker(routes)]) as (base, serving):
            router = serving.router
            worker = router.pool.all()[0]
            other = router.make_worker(await endless_health.start(), worker.role)
            with PeakRss() as rss:
                async with aiohttp.ClientSession() as s:
                    for path in ("/v1/models", "/model_info", "/health_generate"):
                        started = time.monotonic()
                        async with s.get(base + path) as r:
                            body = await r.read()
                            assert r.status == 502, (path, r.status, len(body))
                        assert time.monotonic() - started < 3.0, path
                started = time.monotonic()
                assert await router.get_json(worker, "/server_info", timeout=10.0) is None
                assert await router._poll_one(worker) is None
                assert await router._probe(other, accepted=False) is False
                flushed = await flush_caches(router)
                assert flushed[worker.url] != 200
                assert time.monotonic() - started < 5.0
            assert rss.peak - rss.start < 64, (rss.start, rss.peak)
        await endless_health.close()
    run(main())


def _loads(value: Any) -> dict[str, Any]:
    return {"loads": [{"num_running_reqs": value, "num_waiting_reqs": value,
                       "num_used_tokens": value, "max_total_num_tokens": value,
                       "token_usage": value, "gen_throughput": value,
                       "max_running_requests": value, "total_prefill_busy_us": value,
                       "total_prefill_uncached_tokens": value,
                       "num_waiting_uncached_tokens": value}] * 2}


def test_load_figures_are_clamped() -> None:
    for value in (1e308, float("inf"), 10**400, -5, -1e308, float("nan"), "7", None, True):
        loads = WorkerLoads.from_json(_loads(value), 0.0)
        for field in ("running_reqs", "waiting_reqs", "used_tokens", "max_total_tokens",
                      "max_running_reqs", "prefill_busy_us", "prefill_uncached_tokens",
                      "waiting_uncached_tokens"):
            got = getattr(loads, field)
            assert isinstance(got, int) and 0 <= got <= MAX_LOAD_COUNT, (value, field, got)
        for field in ("token_usage", "gen_throughput"):
            got = getattr(loads, field)
            assert isinstance(got, float) and 0.0 <= got <= 1e12, (value, field, got)
        json.dumps(dataclass_dict(loads), allow_nan=False)
    assert load_count(12.9) == 12 and load_count(2**60) == MAX_LOAD_COUNT
    assert load_rate(0.5) == 0.5 and load_rate(float("-inf")) == 0.0


def dataclass_dict(loads: WorkerLoads) -> dict[str, Any]:
    import dataclasses
    return dataclasses.asdict(loads)


@pytest.mark.parametrize("policy", ["cache_aware", "oas"])
def test_huge_load_figures_break_no_route_and_no_poll(policy: str) -> None:
    state = {"raw": b'{"loads": [{"num_running_reqs": 1e308, "num_waiting_reqs": 1e308, '
                    b'"num_used_tokens": 1e308, "max_total_num_tokens": 1e308, '
                    b'"gen_throughput": 1e308, "token_usage": 1e308, '
                    b'"max_running_requests": -1e308, "total_prefill_busy_us": 1e308, '
                    b'"total_prefill_uncached_tokens": 1e308}, '
                    b'{"num_running_reqs": 1e308, "token_usage": -3}]}'}

    async def loads(request: web.Request) -> web.Response:
        return web.Response(body=state["raw"], content_type="application/json")

    async def main() -> None:
        async with router_for([ScriptedWorker({"/v1/loads": loads})], policy=policy,
                              loads_poll_interval_secs=0.05) as (base, serving):
            worker = serving.router.pool.all()[0]
            await asyncio.sleep(0.4)
            async with aiohttp.ClientSession() as s:
                for path in ("/metrics", "/list_workers", "/server_info"):
                    async with s.get(base + path) as r:
                        assert r.status == 200, (path, await r.text())
            state["raw"] = json.dumps(_loads(3)).encode()  # an honest answer later
            deadline = time.monotonic() + 5
            while worker.loads.running_reqs != 6 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert worker.loads.running_reqs == 6
    run(main())


def test_a_loop_that_raises_is_logged_counted_and_restarted(
        caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        async with router_for([ScriptedWorker()], loads_poll_interval_secs=0.02) as (base,
                                                                                     serving):
            router = serving.router
            calls = []

            async def flaky() -> None:
                calls.append(time.monotonic())
                if len(calls) == 1:
                    raise RuntimeError("boom")

            router.poll_loads = flaky  # type: ignore[method-assign]
            deadline = time.monotonic() + 5
            while len(calls) < 3 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert len(calls) >= 3
            async with aiohttp.ClientSession() as s:
                async with s.get(base + "/metrics") as r:
                    text = await r.text()
            assert 'omniproxy_background_task_failures_total{task="loads"} 1.0' in text
    run(main())
    logged = [r for r in caplog.records if r.exc_info and "loads" in r.getMessage()]
    assert logged and "boom" in str(logged[0].exc_info[1])


def test_supervise_restarts_after_a_return_and_a_raise() -> None:
    async def main() -> None:
        failures: list[str] = []
        runs = []

        async def body() -> None:
            runs.append(1)
            if len(runs) == 2:
                raise ValueError("x")

        task = asyncio.create_task(supervise("t", body, failures.append))
        while len(runs) < 4:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert failures == ["t"]
    run(main(), timeout=10)


SPELLINGS = ("http://0x7f000001:{p}", "http://2130706433:{p}", "http://127.1:{p}",
             "http://017700000001:{p}", "http://0x7f.0.0.1:{p}", "http://127.0.1:{p}",
             "http://0177.0.0.01:{p}", "http://[::ffff:127.0.0.1]:{p}", "http://LOCALHOST:{p}")
UNSPECIFIED = ("http://0.0.0.0:{p}", "http://0:{p}", "http://[::]:{p}", "http://0x0:{p}",
               "http://[::ffff:0.0.0.0]:{p}", "http://000.0.0:{p}")


def test_numeric_ipv4_spellings_have_one_canonical_url() -> None:
    import socket
    for spelling in SPELLINGS:
        assert normalize_url(spelling.format(p=8000)) == "http://127.0.0.1:8000", spelling
    for host in ("10.1", "0xa.0x1.0.07", "167772167", "1.2.3"):
        expected = socket.inet_ntoa(socket.inet_aton(host))
        assert normalize_url(f"http://{host}:1") == f"http://{expected}:1"
    for name in ("08.1.1.1", "1.2.3.4.5", "0x100000000", "256.1.1.1", "1e5", "x0x7f"):
        assert normalize_url(f"http://{name}:1") == f"http://{name}:1"  # names, not addresses
    for spelling in UNSPECIFIED:
        with pytest.raises(ValueError, match="unspecified"):
            normalize_url(spelling.format(p=8000))


def test_one_worker_cannot_be_added_again_under_another_ipv4_spelling() -> None:
    async def main() -> None:
        async with router_for([ScriptedWorker()]) as (base, serving):
            port = int(serving.router.pool.all()[0].url.rsplit(":", 1)[1])
            async with aiohttp.ClientSession() as s:
                for spelling in SPELLINGS[:5] + UNSPECIFIED[:1]:
                    async with s.post(base + "/add_worker",
                                      json={"url": spelling.format(p=port)}) as r:
                        assert r.status == 400, (spelling, await r.text())
            assert len(serving.router.pool.all()) == 1
    run(main())


def test_pd_health_generate_needs_a_prefill_and_a_decode_worker(tmp_path: Path) -> None:
    prefill = EmulatorProcess("prefill", log_path=tmp_path / "p.log")
    decode = EmulatorProcess("decode", log_path=tmp_path / "d.log")

    async def main() -> None:
        port = free_port()
        serving = await open_router(RouterConfig(
            pd_disaggregation=True, prefill_urls=[(prefill.url, prefill.bootstrap_port)],
            decode_urls=[decode.url], host="127.0.0.1", port=port, loads_poll_interval_secs=0,
            disable_health_check=True))
        base = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as s:
                async with s.get(base + "/health_generate") as r:
                    assert r.status == 200, await r.text()
                prefill.stop()
                await asyncio.sleep(HEALTH_GENERATE_TTL_S + 0.1)  # the shared answer expires
                async with s.get(base + "/health_generate") as r:
                    assert r.status == 503, await r.text()
                    assert "prefill" in await r.text()
        finally:
            await serving.close()

    try:
        for w in (prefill, decode):
            w.launch()
        for w in (prefill, decode):
            w.wait_ready()
        run(main())
    finally:
        prefill.stop()
        decode.stop()


def test_an_endless_5xx_body_is_not_read_to_the_answer_cap() -> None:
    written = [0]  # MiB the worker got to send (a router before the fix read 64)

    async def endless_500(request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(status=500, headers={"Content-Type": "text/plain"})
        await out.prepare(request)
        with contextlib.suppress(ConnectionError, RuntimeError):
            for _ in range(ENDLESS_CAP_MB):
                await out.write(b"e" * (1 << 20))
                written[0] += 1
        return out

    async def main() -> None:
        async with router_for([ScriptedWorker({"/generate": endless_500})],
                              retry_max_retries=0) as (base, _):
            async with aiohttp.ClientSession() as s:
                async with s.post(base + "/generate", json={"text": "hi"}) as r:
                    await r.read()
                    assert r.status >= 500
            await asyncio.sleep(0.5)
        assert 0 < written[0] < 8, written
    run(main())
