"""sglang-router's client-facing extras: request ids from client headers (``X-Request-Id``
back, the access log), CORS for browser origins (preflight and streams), and the token-bucket
rate limit (429 with Retry-After). In process, against a scripted worker."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from router_inproc import ScriptedWorker, router_for

from omniinfer.proxy.admission import RateLimit, Rejected
from omniinfer.proxy.config import RouterConfig


async def _generate(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    if body.get("stream"):
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(b'data: {"text": "a", "meta_info": {"completion_tokens": 1}}\n\n'
                        b"data: [DONE]\n\n")
        return out
    return web.json_response({"text": "a", "meta_info": {"completion_tokens": 1}})


def _worker() -> ScriptedWorker:
    return ScriptedWorker({"/generate": _generate})


async def _post(session: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None,
                stream: bool = False, body: Any = None) -> tuple[int, Any, bytes]:
    payload = {"text": "hi", "stream": stream} if body is None else body
    async with session.post(url + "/generate", json=payload, headers=headers or {}) as resp:
        return resp.status, resp.headers, await resp.read()


def test_request_ids_come_from_client_headers_or_are_made(tmp_path: Path) -> None:
    log = tmp_path / "access.jsonl"

    async def run() -> None:
        async with router_for([_worker()], access_log=str(log)) as (base, _), \
                aiohttp.ClientSession() as session:
            # the defaults, in their order: x-request-id before x-trace-id
            _, headers, _ = await _post(session, base, {"X-Trace-Id": "t-1",
                                                        "X-Request-Id": "req-7"})
            assert headers["X-Request-Id"] == "req-7"
            _, headers, _ = await _post(session, base, {"x-correlation-id": "corr-2"},
                                        stream=True)
            assert headers["X-Request-Id"] == "corr-2"  # a stream carries it too
            _, headers, _ = await _post(session, base)
            made = headers["X-Request-Id"]
            assert made.startswith("r") and len(made) > 8
            _, headers, _ = await _post(session, base, {"X-Request-Id": "x" * 300})
            assert headers["X-Request-Id"] != "x" * 300  # too long: one of ours instead
            status, headers, _ = await _post(session, base, {"Request-Id": "bad-1"}, body=[1])
            assert status == 400 and headers["X-Request-Id"] == "bad-1"  # errors carry it
        async with router_for([_worker()], request_id_headers=["x-my-id"]) as (base, _), \
                aiohttp.ClientSession() as session:
            _, headers, _ = await _post(session, base, {"X-Request-Id": "a", "X-My-Id": "b"})
            assert headers["X-Request-Id"] == "b"

    asyncio.run(run())
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r.get("request_id") for r in records[:2]] == ["req-7", "corr-2"]
    assert "request_id" not in records[2]  # made by the router: its own id


def test_cors_only_for_the_allowed_origins() -> None:
    async def run() -> None:
        async with router_for([_worker()], cors_allowed_origins=["https://app.example"],
                              api_key="k") as (base, _), aiohttp.ClientSession() as session:
            preflight = {"Origin": "https://app.example",
                         "Access-Control-Request-Method": "POST"}
            async with session.options(base + "/generate", headers=preflight) as resp:
                assert resp.status == 204  # before authentication: no key on a preflight
                assert resp.headers["Access-Control-Allow-Origin"] == "https://app.example"
                assert "POST" in resp.headers["Access-Control-Allow-Methods"]
                assert "Authorization" in resp.headers["Access-Control-Allow-Headers"]
            async with session.options(base + "/generate", headers={
                    **preflight, "Origin": "https://evil.example"}) as resp:
                assert resp.status == 403 and "Access-Control-Allow-Origin" not in resp.headers
            key = {"Authorization": "Bearer k", "Origin": "https://app.example"}
            status, headers, _ = await _post(session, base, key, stream=True)
            assert status == 200 and headers["Access-Control-Allow-Origin"] == "https://app.example"
            assert "x-request-id" in headers["Access-Control-Expose-Headers"]
            _, headers, _ = await _post(session, base, {**key, "Origin": "https://evil.example"})
            assert "Access-Control-Allow-Origin" not in headers
        async with router_for([_worker()]) as (base, _), aiohttp.ClientSession() as session:
            _, headers, _ = await _post(session, base, {"Origin": "https://app.example"})
            assert "Access-Control-Allow-Origin" not in headers  # none configured: none sent

    asyncio.run(run())


@pytest.mark.parametrize("origins", [["app.example"], ["https://a/b"], ["ftp://a"], ["*", ""]])
def test_bad_cors_origins_are_usage_errors(origins: list[str]) -> None:
    with pytest.raises(ValueError, match="cors-allowed-origins"):
        RouterConfig(worker_urls=["http://a:1"], cors_allowed_origins=origins).validate()


def test_bad_request_id_header_names_are_usage_errors() -> None:
    with pytest.raises(ValueError, match="request-id-headers"):
        RouterConfig(worker_urls=["http://a:1"], request_id_headers=["x id"]).validate()


def test_token_bucket_waits_in_order_and_refuses_past_its_bounds() -> None:
    now = [0.0]

    async def run() -> None:
        bucket = RateLimit(rate=10.0, capacity=2, max_waiting=1, max_wait_s=0.5,
                           clock=lambda: now[0])
        await bucket.take()
        await bucket.take()  # the burst: capacity 2
        waiter = asyncio.create_task(bucket.take())  # reserves the next token: 0.1 s
        await asyncio.sleep(0)
        assert bucket.waiting == 1
        with pytest.raises(Rejected) as refused:  # a second waiter is past max_waiting
            await bucket.take()
        assert refused.value.status == 429 and refused.value.reason == "rate_limited"
        waiter.cancel()  # gives its token back
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert bucket.tokens == pytest.approx(0.0)
        now[0] = 1.0  # refilled to capacity, not beyond
        bucket._refill()
        assert bucket.tokens == 2

    asyncio.run(run())


def test_rate_limit_answers_429_with_retry_after() -> None:
    async def run() -> None:
        async with router_for([_worker()], rate_limit_tokens_per_second=0.5,
                              max_concurrent_requests=2, queue_size=4,
                              queue_timeout_secs=0.5) as (base, _), \
                aiohttp.ClientSession() as session:
            statuses = [await _post(session, base) for _ in range(3)]
        assert [s for s, _, _ in statuses[:2]] == [200, 200]
        status, headers, body = statuses[2]
        assert status == 429 and int(headers["Retry-After"]) >= 1
        assert json.loads(body)["error"]["type"] == "overloaded"

    asyncio.run(run())


def test_every_answer_carries_the_id_and_a_bad_first_header_falls_through() -> None:
    async def run() -> None:
        dead = ScriptedWorker({"/generate": _generate})
        async with router_for([dead]) as (base, serving), aiohttp.ClientSession() as session:
            for worker in serving.router.pool.all():
                worker.healthy = False  # no healthy worker: the router's own 503
            status, headers, _ = await _post(session, base, {"X-Request-Id": "x" * 300,
                                                             "X-Trace-Id": "second"})
            assert status == 503 and headers["X-Request-Id"] == "second"

    asyncio.run(run())


def test_a_failing_tracer_costs_no_request() -> None:
    async def run() -> None:
        async with router_for([_worker()]) as (base, serving), aiohttp.ClientSession() as session:
            class Broken:
                def begin(self, *_: Any) -> Any:
                    raise RuntimeError("exporter misconfigured")

                def close(self) -> None:
                    pass

            serving.router.tracing = Broken()  # type: ignore[assignment]
            status, _, _ = await _post(session, base)
            assert status == 200 and serving.router.drain.in_flight == 0

    asyncio.run(run())
