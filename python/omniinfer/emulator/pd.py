"""PD pairing across emulator processes (our design; SGLang's bootstrap server speaks its own).

A ``prefill`` emulator serves a small *bootstrap endpoint* on its
``--disaggregation-bootstrap-port``:

    GET /emulator/kv/{room}?wait=S&bandwidth_gb_s=B

It long-polls up to S seconds for the prefill of ``room`` to finish (404 ``{"status":
"pending"}`` when it has not), then answers ``{"room", "prompt_tokens", "cached_tokens",
"first_token", "transfer_s"}``, where ``transfer_s`` is the prefill's transfer model with the
bandwidth capped at the decode side's B, and frees the held KV ``transfer_s`` later. A
``decode`` emulator receiving a request with ``bootstrap_host/port/room`` registers it (so an
abort reaches it), polls that endpoint until ``bootstrap_timeout_s``, waits for KV room, sleeps
``transfer_s``, emits the prefill's first token and decodes the rest.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import orjson
from aiohttp import web

from omniinfer.emulator.engine import EmulatedEngine
from omniinfer.emulator.profile import Profile
from omniinfer.emulator.request import EmuRequest

POLL_WAIT_S = 10.0  # one long poll; the decode side repeats until its bootstrap timeout
RETRY_S = 0.05  # after a refused connection (the prefill worker not up yet)


def _json(obj: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


def bootstrap_app(engine: EmulatedEngine, profile: Profile) -> web.Application:
    """The prefill side's bootstrap endpoint."""

    async def kv_pull(http: web.Request) -> web.Response:
        try:
            room = int(http.match_info["room"])
            wait = min(float(http.query.get("wait", str(POLL_WAIT_S))), 60.0)
            peer_bw = float(http.query.get("bandwidth_gb_s", "inf"))
        except ValueError:
            return _json({"error": "room must be an integer, wait and bandwidth_gb_s numbers"}, 400)
        if not wait >= 0 or not peer_bw > 0:
            return _json({"error": "wait must be >= 0 and bandwidth_gb_s > 0"}, 400)
        request = await engine.wait_room(room, wait)
        if request is None:
            return _json({"status": "pending", "room": room}, 404)
        transfer = profile.transfer
        transfer_s = engine.cost.transfer_time(request.prompt_tokens)
        if peer_bw < transfer.bandwidth_gb_s:  # the slower end bounds the transfer
            transfer_s = transfer.latency_s + (transfer_s - transfer.latency_s) * transfer.bandwidth_gb_s / peer_bw
        engine.kv_fetched(room, transfer_s)
        return _json({
            "room": room, "prompt_tokens": request.prompt_tokens, "cached_tokens": request.cached_tokens,
            "first_token": request.output_ids[0] if request.output_ids else 0,
            "transfer_s": transfer_s,
        })

    async def health(_http: web.Request) -> web.Response:
        return web.Response(status=200)

    app = web.Application()
    app.router.add_get("/emulator/kv/{room}", kv_pull)
    app.router.add_get("/health", health)
    return app


async def pull_kv(client: aiohttp.ClientSession, profile: Profile, request: EmuRequest,
                  host: str, port: int, room: int) -> str | None:
    """Decode side: wait for the paired prefill's KV; sets ``first_token``, ``transfer_s`` and
    ``cached_tokens``. Returns None when it arrived, else why not (an abort ends the wait too)."""
    url = f"http://{host}:{port}/emulator/kv/{room}"
    deadline = time.monotonic() + profile.transfer.bootstrap_timeout_s
    params = {"wait": str(POLL_WAIT_S), "bandwidth_gb_s": str(profile.transfer.bandwidth_gb_s)}
    last_error = "no answer"
    while time.monotonic() < deadline and not request.finished:
        poll = asyncio.ensure_future(_poll(client, url, params))
        aborted = asyncio.ensure_future(request.wait_progress())
        try:
            await asyncio.wait({poll, aborted}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (poll, aborted):
                task.cancel()
        if request.finished or poll.cancelled():
            break
        info, error = poll.result()
        if info is not None:
            request.first_token = int(info["first_token"])
            request.transfer_s = float(info["transfer_s"])
            request.cached_tokens = int(info.get("cached_tokens", 0))
            return None
        last_error = error
    if request.finished:
        return "aborted while waiting for the prefill"
    return f"prefill bootstrap {host}:{port} room {room}: {last_error}"


async def _poll(client: aiohttp.ClientSession, url: str, params: dict[str, str]
                ) -> tuple[dict[str, object] | None, str]:
    try:
        async with client.get(url, params=params) as response:
            if response.status == 200:
                return await response.json(), ""
            return None, f"HTTP {response.status}"
    except (aiohttp.ClientError, OSError) as exc:
        await asyncio.sleep(RETRY_S)  # back off before the next attempt on a refused connection
        return None, f"{type(exc).__name__}: {exc}"
