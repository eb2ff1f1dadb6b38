"""smg 1.13's worker API (``/workers``) beside sglang-router's routes: registration in the
background with retries, ids derived from URLs, listing with stats, PATCH metadata, PUT, DELETE,
fields that cannot be honoured refused, and the admin key rules. In process, scripted workers."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import aiohttp
from aiohttp import web
from router_inproc import ScriptedWorker, router_for

from omniinfer.child_process import free_port
from omniinfer.proxy.auth import admin_kind
from omniinfer.proxy.worker_api import worker_id

KEYS = ["a1:ops:admin:admin-key", "u1:app:user:user-key"]


async def _generate(request: web.Request) -> web.Response:
    return web.json_response({"text": f"from {request.host}",
                              "meta_info": {"completion_tokens": 1}})


async def _until(check: Any, timeout: float = 10.0) -> Any:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = await check()
        if value or asyncio.get_running_loop().time() > deadline:
            return value
        await asyncio.sleep(0.05)


def test_register_list_patch_replace_delete() -> None:
    async def run() -> None:
        first, second = ScriptedWorker({"/generate": _generate}), \
            ScriptedWorker({"/generate": _generate})
        second_url = await second.start()
        async with router_for([first]) as (base, serving), aiohttp.ClientSession() as s:
            first_url = serving.router.pool.all()[0].url
            async with s.post(base + "/workers", json={
                    "url": second_url, "worker_type": "regular", "labels": {"zone": "a"},
                    "priority": 5}) as resp:
                assert resp.status == 202
                body = await resp.json()
                wid = body["worker_id"]
                assert wid == worker_id(second_url) and uuid.UUID(wid).version == 5
                assert resp.headers["Location"] == f"/workers/{wid}" == body["location"]

            async def registered() -> Any:
                async with s.get(f"{base}/workers/{wid}") as resp:
                    data = await resp.json()
                    return data if data.get("is_healthy") else None

            one = await _until(registered)
            assert one["url"] == second_url and one["labels"] == {"zone": "a"}
            async with s.post(base + "/workers", json={"url": second_url}) as resp:
                assert resp.status == 409 and (await resp.json())["code"] == "WORKER_ALREADY_EXISTS"
            async with s.get(base + "/workers") as resp:
                listing = await resp.json()
            assert listing["total"] == 2 and listing["stats"] == {
                "prefill_count": 0, "decode_count": 0, "regular_count": 2}
            assert {w["id"] for w in listing["workers"]} == {wid, worker_id(first_url)}
            async with s.patch(f"{base}/workers/{wid}", json={"labels": {"zone": "b"}}) as resp:
                assert resp.status == 202
            async with s.get(f"{base}/workers/{wid}") as resp:
                assert (await resp.json())["labels"] == {"zone": "b"}
            async with s.patch(f"{base}/workers/{wid}", json={"url": "http://x:1"}) as resp:
                assert resp.status == 400
            async with s.put(f"{base}/workers/{wid}", json={"url": "http://127.0.0.1:9"}) as resp:
                assert resp.status == 400 and "URL mismatch" in (await resp.json())["error"]
            async with s.put(f"{base}/workers/{wid}", json={"url": second_url,
                                                            "priority": 1}) as resp:
                assert resp.status == 202
            assert (await _until(registered))["priority"] == 1
            async with s.delete(f"{base}/workers/{wid}") as resp:
                assert resp.status == 202
            assert [w.url for w in serving.router.pool.all()] == [first_url]
            async with s.get(f"{base}/workers/{wid}") as resp:
                assert resp.status == 404 and (await resp.json())["code"] == "WORKER_NOT_FOUND"
            async with s.get(f"{base}/workers/not-a-uuid") as resp:
                assert resp.status == 400 and (await resp.json())["code"] == "BAD_REQUEST"
        await second.close()

    asyncio.run(run())


def test_a_worker_that_starts_late_is_registered_and_a_dead_one_fails() -> None:
    async def run() -> None:
        async with router_for([ScriptedWorker()]) as (base, serving), aiohttp.ClientSession() as s:
            port = free_port()
            late_url = f"http://127.0.0.1:{port}"
            async with s.post(base + "/workers", json={"url": late_url}) as resp:
                wid = (await resp.json())["worker_id"]
            async with s.get(f"{base}/workers/{wid}") as resp:
                assert (await resp.json())["job_status"] == "pending"
            await asyncio.sleep(1.5)  # a failed health check or two, then the worker is up
            app = web.Application()
            app.router.add_get("/health", lambda r: web.json_response({}))
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            try:
                assert await _until(lambda: asyncio.sleep(0, serving.router.pool.get(late_url)))
            finally:
                await runner.cleanup()
            dead = f"http://127.0.0.1:{free_port()}"
            async with s.post(base + "/workers", json={"url": dead,
                                                       "max_connection_attempts": 1}) as resp:
                dead_id = (await resp.json())["worker_id"]

            async def failed() -> Any:
                async with s.get(f"{base}/workers/{dead_id}") as resp:
                    data = await resp.json()
                    return data if data.get("job_status") == "failed" else None

            job = await _until(failed)
            assert job["attempts"] == 1 and "health check" in job["error"]

    asyncio.run(run())


def test_fields_that_cannot_be_honoured_are_refused() -> None:
    async def run() -> None:
        async with router_for([ScriptedWorker()]) as (base, _), aiohttp.ClientSession() as s:
            for body, fragment in [
                    ({"url": "http://127.0.0.1:9", "api_key": "k"}, "api_key"),
                    ({"url": "http://127.0.0.1:9", "connection_mode": "grpc"}, "http"),
                    ({"url": "http://127.0.0.1:9", "runtime_type": "vllm"}, "sglang"),
                    ({"url": "http://127.0.0.1:9", "surprise": 1}, "surprise"),
                    ({"url": "http://127.0.0.1:9", "worker_type": "prefill"}, "not served"),
                    ({"url": "http://127.0.0.1:9/path"}, "URL"),
                    ({"url": "http://127.0.0.1:9", "labels": {"k": 1}}, "labels")]:
                async with s.post(base + "/workers", json=body) as resp:
                    data = await resp.json()
                    assert resp.status == 400 and data["code"] == "BAD_REQUEST", body
                    assert fragment in data["error"], (fragment, data)
            async with s.post(base + "/workers", data=b"x" * 70_000) as resp:
                assert resp.status == 400

    asyncio.run(run())


def test_worker_api_follows_the_admin_key_rules() -> None:
    assert admin_kind("GET", "/workers") == "read" == admin_kind("GET", "/workers/x")
    assert admin_kind("POST", "/workers") == "mutating" == admin_kind("DELETE", "/workers/x")
    assert admin_kind("POST", "/generate") is None and admin_kind("GET", "/workersx") is None

    async def run() -> None:
        async with router_for([ScriptedWorker()], control_plane_api_keys=KEYS) as (base, _), \
                aiohttp.ClientSession() as s:
            for key, expected in [(None, 401), ("user-key", 403), ("admin-key", 200)]:
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                async with s.get(base + "/workers", headers=headers) as resp:
                    assert resp.status == expected, key
            async with s.post(base + "/workers", json={"url": "http://127.0.0.1:9"},
                              headers={"Authorization": "Bearer user-key"}) as resp:
                assert resp.status == 403

    asyncio.run(run())


def test_large_chunked_bodies_bad_puts_and_failing_jobs() -> None:
    async def run() -> None:
        async with router_for([ScriptedWorker()]) as (base, serving), aiohttp.ClientSession() as s:
            url = serving.router.pool.all()[0].url
            wid = worker_id(url)
            big = {"url": "http://127.0.0.1:9", "models": [f"m{i}-" + "x" * 240 for i in range(60)],
                   "labels": {f"k{i}": "v" * 1000 for i in range(20)}}
            payload = json.dumps(big).encode()
            assert 30_000 < len(payload) < 64 * 1024

            async def chunks() -> Any:
                for i in range(0, len(payload), 4096):
                    yield payload[i:i + 4096]

            async with s.post(base + "/workers", data=chunks(),
                              headers={"Content-Type": "application/json"}) as resp:
                assert resp.status == 202, await resp.text()  # read whole, not one chunk
            async with s.put(f"{base}/workers/{wid}", json={
                    "url": url, "max_connection_attempts": 0}) as resp:
                assert resp.status == 400
            assert serving.router.pool.get(url) is not None  # a refused PUT removes nothing
            async with s.post(base + "/workers", json={"url": "http://127.0.0.1:8",
                                                       "models": 5}) as resp:
                assert resp.status == 400 and "models" in (await resp.json())["error"]

            async def broken(*_: Any) -> None:
                raise RuntimeError("boom")

            serving.router.add_worker = broken  # type: ignore[method-assign]
            async with s.post(base + "/workers", json={"url": "http://127.0.0.1:7"}) as resp:
                job_id = (await resp.json())["worker_id"]

            async def failed() -> Any:
                async with s.get(f"{base}/workers/{job_id}") as resp:
                    data = await resp.json()
                    return data if data.get("job_status") == "failed" else None

            job = await _until(failed, 5.0)
            assert job and "RuntimeError: boom" in job["error"]  # failed, not pending for ever

    asyncio.run(run())
