"""Graceful shutdown (``drain.py``): requests in flight end on their own within the grace period
or are cut with exactly one terminal answer; new requests are refused; the workers are told to
abort what was cut. In process against scripted workers, and as a real router process that gets
SIGTERM during 50 streams from an emulated worker."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from proxy_helpers import sse_events
from router_inproc import ScriptedWorker, router_for

from omniinfer.emulator.process import EmulatorProcess
from omniinfer.proxy.process import RouterProcess


def _stream_worker(hold_headers: set[str]) -> ScriptedWorker:
    """``/generate``: ``sampling_params.max_new_tokens`` events 50 ms apart, then [DONE]; a
    prompt in ``hold_headers`` never gets an answer (not even headers)."""

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body["text"] in hold_headers:
            await asyncio.sleep(3600)
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        n = body["sampling_params"]["max_new_tokens"]
        for i in range(n):
            await out.write(b"data: " + json.dumps({"text": "x" * (i + 1), "meta_info": {
                "completion_tokens": i + 1}}).encode() + b"\n\n")
            await asyncio.sleep(0.05)
        await out.write(b"data: [DONE]\n\n")
        return out

    return ScriptedWorker({"/generate": generate})


async def _call(session: aiohttp.ClientSession, base: str, text: str, n: int,
                began: list[str] | None = None) -> tuple[int, str]:
    """One streamed /generate; its text goes on ``began`` once the answer's head arrived."""
    async with session.post(base + "/generate", json={
            "text": text, "stream": True, "sampling_params": {"max_new_tokens": n}}) as resp:
        if began is not None:
            began.append(text)
        return resp.status, (await resp.read()).decode()


def _errors(events: list[Any]) -> list[dict[str, Any]]:
    return [e["error"] for e in events if isinstance(e, dict) and "error" in e]


def test_drain_lets_short_requests_finish_and_cuts_the_rest_with_one_answer() -> None:
    async def run() -> None:
        worker = _stream_worker(hold_headers={"held-0", "held-1"})
        async with router_for([worker]) as (base, serving):
            async with aiohttp.ClientSession() as session, \
                    aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as probe:
                assert (await probe.get(base + "/health")).status == 200  # a kept-alive line
                calls = [asyncio.create_task(_call(session, base, f"short-{i}", 4))
                         for i in range(10)]
                calls += [asyncio.create_task(_call(session, base, f"long-{i}", 10_000))
                          for i in range(10)]
                calls += [asyncio.create_task(_call(session, base, f"held-{i}", 5))
                          for i in range(2)]
                for _ in range(200):
                    if serving.router.drain.in_flight == 22:
                        break
                    await asyncio.sleep(0.02)
                assert serving.router.drain.in_flight == 22
                started = time.monotonic()
                draining = asyncio.create_task(serving.drain(1.0))
                await asyncio.sleep(0.1)
                health = await probe.get(base + "/health")  # same connection, still open
                assert health.status == 503
                late = await probe.post(base + "/generate", json={"text": "late"})
                assert late.status == 503 and (await late.json())["error"]["type"] == "unavailable"
                cut = await draining
                elapsed = time.monotonic() - started
                results = await asyncio.gather(*calls)
        assert cut == 12  # the ten long streams and the two that never began
        assert 1.0 <= elapsed < 3.0
        for i, (status, text) in enumerate(results):
            if i < 10:  # finished within the grace period: the worker's answer, untouched
                assert status == 200 and text.rstrip().endswith("data: [DONE]")
                assert not _errors(sse_events(text))
            elif i < 20:  # cut mid-stream: its events, one shutdown error, [DONE]
                events = sse_events(text)
                assert status == 200 and text.rstrip().endswith("data: [DONE]"), text[-200:]
                assert [e["type"] for e in _errors(events)] == ["shutdown"]
                assert isinstance(events[-2], dict) and "error" in events[-2]
                assert len(events) > 3  # it had streamed before the cut
            else:  # cut before any byte: one JSON error
                assert status == 503 and json.loads(text)["error"]["type"] == "unavailable"
        aborted = [json.loads(body)["rid"] for _, path, _, body in worker.seen
                   if path == "/abort_request"]
        assert len(aborted) == 12 and len(set(aborted)) == 12

    asyncio.run(run())


def test_drain_with_nothing_in_flight_returns_at_once() -> None:
    async def run() -> None:
        async with router_for([_stream_worker(set())]) as (_, serving):
            started = time.monotonic()
            assert await serving.drain(30.0) == 0
            assert time.monotonic() - started < 1.0

    asyncio.run(run())


def test_a_second_signal_cuts_at_once() -> None:
    async def run() -> None:
        async with router_for([_stream_worker(set())]) as (base, serving):
            async with aiohttp.ClientSession() as session:
                call = asyncio.create_task(_call(session, base, "long", 10_000))
                while serving.router.drain.in_flight == 0:
                    await asyncio.sleep(0.02)
                hurry = asyncio.Event()
                started = time.monotonic()
                draining = asyncio.create_task(serving.drain(60.0, hurry))
                await asyncio.sleep(0.2)
                hurry.set()
                assert await draining == 1
                assert time.monotonic() - started < 2.0
                status, text = await call
        assert status == 200 and [e["type"] for e in _errors(sse_events(text))] == ["shutdown"]

    asyncio.run(run())


def test_sigterm_during_50_streams_ends_each_with_done_or_one_error(tmp_path: Path) -> None:
    """The real process: SIGTERM while 50 streams run on an emulated worker; grace 2 s."""
    with EmulatorProcess(time_scale=0.2, log_path=tmp_path / "w.log") as worker:
        router = RouterProcess(["--worker-urls", worker.url, "--shutdown-grace-period-secs", "2",
                                "--prometheus-port", "0"], tmp_path / "r.log")
        with router:
            async def run() -> list[tuple[int, str]]:
                async with aiohttp.ClientSession() as session:
                    # 10 short ones end within the grace period, 40 long ones are cut; the
                    # signal comes once every answer has begun. The long ones ask for 400
                    # tokens: the worker's 16,384-token KV pool admits all 40 at once
                    # (0.7 x 400 reserved each); with 5,000 some waited unadmitted, with no
                    # answer begun, and a fixed 1 s sleep before the signal then cut them
                    # with a 503 now and then.
                    began: list[str] = []
                    calls = [asyncio.create_task(_call(session, router.base_url, f"p{i}",
                                                       10 if i < 10 else 400, began))
                             for i in range(50)]
                    deadline = time.monotonic() + 30.0
                    while len(began) < 50 and time.monotonic() < deadline:
                        await asyncio.sleep(0.05)
                    assert len(began) == 50, f"only {len(began)} of 50 streams began"
                    assert router.process is not None
                    os.kill(router.process.pid, signal.SIGTERM)
                    started = time.monotonic()
                    out = await asyncio.wait_for(asyncio.gather(*calls), 20.0)
                    assert time.monotonic() - started < 2.0 + 3.0
                    return out

            results = asyncio.run(run())
            assert router.process is not None
            assert router.process.wait(timeout=20) == 0
        kinds = []
        for status, text in results:
            assert status == 200 and text.rstrip().endswith("data: [DONE]"), text[-300:]
            errors = _errors(sse_events(text))
            assert len(errors) <= 1
            kinds.append(errors[0]["type"] if errors else "done")
        assert kinds[:10] == ["done"] * 10 and kinds[10:] == ["shutdown"] * 40
        assert "40 request(s) cut" in router.log_tail(200)


def test_a_stream_cut_after_its_done_event_gets_no_second_answer() -> None:
    """The worker sent [DONE] but keeps its stream open: the client has its whole answer, and a
    shutdown cut must not write a 503 after it on the same connection."""
    from router_inproc import raw_exchange

    async def done_then_hang(request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(b'data: {"text": "a", "meta_info": {"completion_tokens": 1}}\n\n'
                        b"data: [DONE]\n\n")
        await asyncio.sleep(3600)
        return out

    async def run() -> bytes:
        async with router_for([ScriptedWorker({"/generate": done_then_hang})]) as (base, serving):
            port = int(base.rsplit(":", 1)[1])
            body = json.dumps({"text": "x", "stream": True}).encode()
            head = (f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n").encode()
            exchange = asyncio.create_task(raw_exchange(port, head + body, timeout=4.0))
            while serving.router.drain.in_flight == 0:
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.3)
            assert await serving.drain(0.2) == 1
            return await exchange

    raw = asyncio.run(run())
    assert raw.count(b"HTTP/1.1 ") == 1 and b"HTTP/1.1 200" in raw, raw[:300]
    assert b"data: [DONE]" in raw and b"shutdown" not in raw
