"""EmulatedPDWorker: a small SGLang-protocol worker emulation for the router's PD and fault tests.

Real SGLang PD disaggregation does not run on a CPU (no KV transfer backend), so these tests use
this emulation: same endpoints and body shapes as SGLang 0.5.23, fake token text. A decode worker
waits for its prefill the way SGLang's does — it polls the prefill worker named by
bootstrap_host/bootstrap_port for the bootstrap_room and hangs until the KV "arrives" or the
request is aborted. Behaviour can be changed at run time (POST /_emulated/config) and what the
worker received is readable (GET /_emulated/log). Run: python proxy_emulated_worker.py --port N
--role regular|prefill|decode.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

import aiohttp
from aiohttp import web

STATE: dict = {
    "role": "regular", "token_delay": 0.002, "prefill_delay": 0.01, "fail_status": 0,
    "prefill_fail": False, "die_after_tokens": -1, "requests": [], "aborts": [],
    "rooms": {}, "aborted": set(), "prefill_response_delay": 0.0, "hang": False,
    "hang_after_tokens": -1,
}


def _aborted(rid: str) -> bool:
    """As SGLang: /abort_request aborts every request whose rid starts with the given one."""
    return any(isinstance(a, str) and rid.startswith(a) for a in STATE["aborted"])


def _json(data: object, status: int = 200) -> web.Response:
    return web.json_response(data, status=status)


async def health(_: web.Request) -> web.Response:
    return web.Response(text="")


async def model_info(_: web.Request) -> web.Response:
    return _json({"model_path": "emulated-model", "tokenizer_path": None, "is_generation": True})


async def server_info(_: web.Request) -> web.Response:
    return _json({"emulated": True, "role": STATE["role"], "max_total_num_tokens": 4096})


async def models(_: web.Request) -> web.Response:
    return _json({"object": "list", "data": [{"id": "emulated-model", "object": "model"}]})


async def loads(_: web.Request) -> web.Response:
    running = sum(1 for r in STATE["requests"] if not r.get("done"))
    return _json({"loads": [{"dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": 0,
                             "num_used_tokens": 10 * running, "max_total_num_tokens": 4096,
                             "token_usage": running / 100.0}]})


async def abort_request(request: web.Request) -> web.Response:
    body = await request.json()
    STATE["aborts"].append(body.get("rid"))
    STATE["aborted"].add(body.get("rid"))
    return web.Response(text="")


async def flush(_: web.Request) -> web.Response:
    return web.Response(text="Cache flushed.")


async def config(request: web.Request) -> web.Response:
    STATE.update(await request.json())
    return _json({"ok": True})


async def get_log(_: web.Request) -> web.Response:
    return _json({"requests": [{k: v for k, v in r.items() if k != "done"} for r in
                               STATE["requests"]], "aborts": STATE["aborts"]})


async def room(request: web.Request) -> web.Response:
    return _json({"state": STATE["rooms"].get(request.match_info["room"], "unknown")})


def _chunk(endpoint: str, rid: str, i: int, n: int) -> dict:
    finish = {"type": "length", "length": n} if i == n else None
    if endpoint == "generate":
        return {"text": f" t{i}", "meta_info": {"id": rid, "completion_tokens": i,
                                                 "finish_reason": finish}}
    delta = {"content": f" t{i}"}
    if endpoint == "chat":
        choice = {"index": 0, "delta": delta, "finish_reason": "length" if finish else None}
        return {"id": rid, "object": "chat.completion.chunk", "choices": [choice]}
    return {"id": rid, "object": "text_completion",
            "choices": [{"index": 0, "text": f" t{i}", "finish_reason": "length" if finish else None}]}


def _final(endpoint: str, rid: str, n: int, prompt: int) -> dict:
    text = "".join(f" t{i}" for i in range(1, n + 1))
    if endpoint == "generate":
        return {"text": text, "meta_info": {"id": rid, "completion_tokens": n,
                                            "prompt_tokens": prompt,
                                            "finish_reason": {"type": "length", "length": n}}}
    usage = {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}
    if endpoint == "chat":
        return {"id": rid, "object": "chat.completion", "usage": usage, "choices": [
            {"index": 0, "message": {"role": "assistant", "content": text},
             "finish_reason": "length"}]}
    return {"id": rid, "object": "text_completion", "usage": usage,
            "choices": [{"index": 0, "text": text, "finish_reason": "length"}]}


async def _wait_for_kv(body: dict, rid: str) -> bool:
    """Decode side: wait until the prefill worker reports the room done; False if aborted."""
    url = f"http://{body['bootstrap_host']}:{body['bootstrap_port']}/_emulated/room/" \
          f"{body['bootstrap_room']}"
    async with aiohttp.ClientSession() as session:
        while not _aborted(rid):
            try:
                async with session.get(url) as resp:
                    if (await resp.json())["state"] == "done":
                        return True
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.005)
    return False


def _endpoint(path: str) -> str:
    return {"/generate": "generate", "/v1/completions": "completions"}.get(path, "chat")


async def generate(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    endpoint = _endpoint(request.path)
    entry = {"path": request.path, "body": body, "t": time.time(),
             "authorization": request.headers.get("Authorization")}
    STATE["requests"].append(entry)
    rid = body.get("rid") or "emulated-rid"
    if STATE["hang"]:  # accepts the request and never answers (until aborted)
        while not _aborted(rid):
            await asyncio.sleep(0.01)
        entry["done"] = True
        return _json(_final(_endpoint(request.path), rid, 0, 0))
    if STATE["fail_status"]:
        return _json({"error": {"message": "emulated failure"}}, status=STATE["fail_status"])
    params = body.get("sampling_params") or {}
    n = (params.get("max_new_tokens") if isinstance(params, dict) else None) or \
        body.get("max_tokens") or body.get("max_completion_tokens") or 8
    if not isinstance(params, dict) or not isinstance(n, int) or isinstance(n, bool) or n < 0:
        return _json({"error": {"message": "bad sampling parameters (emulated check)"}}, 400)
    n = min(n, 256)
    role = STATE["role"]
    try:
        if role == "prefill":
            room_id = str(body.get("bootstrap_room"))
            STATE["rooms"][room_id] = "pending"
            await asyncio.sleep(STATE["prefill_delay"])
            if STATE["prefill_fail"]:
                STATE["rooms"][room_id] = "failed"
                return _json({"error": {"message": "emulated prefill failure"}}, status=500)
            STATE["rooms"][room_id] = "done"
            await asyncio.sleep(STATE["prefill_response_delay"])  # KV sent, answer late
            n = 1
        elif role == "decode":
            if "bootstrap_room" not in body:
                return _json({"error": {"message": "decode worker needs bootstrap_room"}}, 400)
            if not await _wait_for_kv(body, rid):
                return _json(_final(endpoint, rid, 0, 0))
        if not body.get("stream"):
            await asyncio.sleep(STATE["token_delay"] * n)
            return _json(_final(endpoint, rid, n, 4))
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for i in range(1, n + 1):
            if _aborted(rid):
                break
            while STATE["hang_after_tokens"] == i - 1 and not _aborted(rid):
                await asyncio.sleep(0.01)  # silent mid-stream, until aborted
            await asyncio.sleep(STATE["token_delay"])
            if STATE["die_after_tokens"] == i - 1:
                os._exit(1)
            await out.write(b"data: " + json.dumps(_chunk(endpoint, rid, i, n)).encode() + b"\n\n")
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out
    finally:
        entry["done"] = True


@web.middleware
async def bad_json(request: web.Request, handler):  # type: ignore[no-untyped-def]
    """SGLang answers malformed bodies with 400 (so does this emulation)."""
    try:
        return await handler(request)
    except (ValueError, AttributeError, TypeError, KeyError) as exc:
        return _json({"error": {"message": f"bad request: {exc}"}}, 400)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--role", default="regular", choices=["regular", "prefill", "decode"])
    parser.add_argument("--token-delay", type=float, default=0.002)
    args = parser.parse_args()
    STATE["role"] = args.role
    STATE["token_delay"] = args.token_delay
    app = web.Application(middlewares=[bad_json])
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health)
    app.router.add_get("/model_info", model_info)
    app.router.add_get("/server_info", server_info)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/loads", loads)
    app.router.add_post("/abort_request", abort_request)
    app.router.add_route("*", "/flush_cache", flush)
    app.router.add_post("/_emulated/config", config)
    app.router.add_get("/_emulated/log", get_log)
    app.router.add_get("/_emulated/room/{room}", room)
    for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
        app.router.add_post(path, generate)
    web.run_app(app, host="127.0.0.1", port=args.port, reuse_address=True, print=None, access_log=None)


if __name__ == "__main__":
    main()
