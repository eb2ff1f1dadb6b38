"""Router CPU time per request, measured in one process: a stable before/after figure even on a
machine other jobs share, where wall latency and even a process's CPU time move by 10-20 %.

The client, OmniProxy (``server.open_router``) and two echo workers (``overhead.echo_app``) run
on one uvloop thread. The thread's CPU time per request is taken straight to a worker, then
through the router; the router's cost is the difference (the best of --repeats rounds of
--requests each, --concurrency at a time). Cross-process costs (wake-ups, a second socket
stack) are not in it, so it is lower than overhead.py's per-process figure.

  python benchmark/router/cpu_per_request.py --policy round_robin
  python benchmark/router/cpu_per_request.py --policy oas --kv-events
  python benchmark/router/cpu_per_request.py --floor   # a minimal aiohttp proxy, for scale
Before/after a change: run it once from a checkout of each (e.g. ``git archive REV python | tar
-x -C /tmp/before`` and ``PYTHONPATH=/tmp/before/python python benchmark/router/...``).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from omniinfer.child_process import free_port
from omniinfer.proxy.config import RouterConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import echo_app, payloads  # noqa: E402


async def start_router(config: RouterConfig) -> Any:
    """``server.open_router``; on a checkout from before it, the same steps by hand (so that a
    before/after comparison runs this one script against both)."""
    try:
        from omniinfer.proxy.server import open_router
    except ImportError:
        pass
    else:
        return await open_router(config)
    from omniinfer.proxy.core import Router
    from omniinfer.proxy.listener import Listener
    from omniinfer.proxy.server import build_app

    router = Router(config)
    await router.start()
    runner = web.AppRunner(build_app(router), handler_cancellation=True, access_log=None)
    await runner.setup()
    listener = Listener(runner.server, config.max_connections, config.client_header_timeout_secs)
    router.listener = listener
    await listener.start(config.host, config.port)

    class Serving:
        async def close(self) -> None:
            await listener.close()
            await runner.cleanup()
            await router.close()

    serving = Serving()
    serving.router = router  # type: ignore[attr-defined]
    return serving


async def start_floor(config: RouterConfig) -> Any:
    """The least an aiohttp proxy does (read, post to a worker in turn, answer): the floor the
    router's own work sits on."""
    workers = itertools.cycle(config.worker_urls)
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                    auto_decompress=False,
                                    headers={"Authorization": f"Bearer {config.api_key}"})

    async def generate(request: web.Request) -> web.Response:
        body = await request.read()
        async with session.post(next(workers) + "/generate", data=body,
                                headers={"Content-Type": "application/json"}) as resp:
            data = await resp.read()
        return web.Response(body=data, content_type="application/json")

    app = web.Application()
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, config.host, config.port).start()

    class Serving:
        async def close(self) -> None:
            await runner.cleanup()
            await session.close()

    return Serving()


async def per_request(url: str, bodies: list[bytes], headers: dict[str, str], requests: int,
                      concurrency: int, repeats: int) -> float:
    """Best thread CPU microseconds per request over ``repeats`` rounds."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        sent = 0

        async def one() -> None:
            nonlocal sent
            body = bodies[sent % len(bodies)]
            sent += 1
            async with session.post(url + "/generate", data=body, headers=headers) as resp:
                await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"{url}: HTTP {resp.status}")

        for _ in range(200 // concurrency):  # warm up, pools open
            await asyncio.gather(*(one() for _ in range(concurrency)))
        best = float("inf")
        for _ in range(repeats):
            start = time.thread_time()
            for _ in range(requests // concurrency):
                await asyncio.gather(*(one() for _ in range(concurrency)))
            best = min(best, (time.thread_time() - start) / requests * 1e6)
        return best


async def subscribed(router: Any, deadline_s: float = 30.0) -> None:
    """Until every worker's KV-event sources are connected."""
    deadline = time.monotonic() + deadline_s
    while True:
        workers = router.cache_truth.describe()["workers"].values()
        sources = [s for w in workers for s in w.get("sources", [])]
        if sources and all(s["connected"] for s in sources):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"KV events not subscribed: {list(workers)}")
        await asyncio.sleep(0.05)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    runners = []
    urls = []
    for _ in range(2):
        port = free_port()
        kv_port = free_port() if args.kv_events else None
        runner = web.AppRunner(echo_app(args.api_key, kv_port, args.prompt_tokens // 2),
                               access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{port}")
    config = RouterConfig(host="127.0.0.1", port=free_port(), worker_urls=urls,
                          policy=args.policy, max_concurrent_requests=0, api_key=args.api_key,
                          cache_truth="kv-events" if args.kv_events else "router",
                          log_level="warning")
    serving = await (start_floor(config) if args.floor else start_router(config))
    try:
        if args.kv_events and not args.floor:
            await subscribed(serving.router)
        headers = {"Content-Type": "application/json"}
        if args.api_key:
            headers["Authorization"] = f"Bearer {args.api_key}"
        bodies = payloads(args.requests, args.prompt_tokens)
        measure = (args.requests, args.concurrency, args.repeats)
        direct = await per_request(urls[0], bodies, headers, *measure)
        routed = await per_request(f"http://127.0.0.1:{config.port}", bodies, headers, *measure)
    finally:
        await serving.close()
        for runner in runners:
            await runner.cleanup()
    return {"router": "floor" if args.floor else "omniproxy", "policy": args.policy,
            "kv_events": args.kv_events,
            "prompt_tokens": args.prompt_tokens, "api_key": bool(args.api_key),
            "concurrency": args.concurrency, "requests": args.requests,
            "direct_us": round(direct, 1), "through_router_us": round(routed, 1),
            "router_cpu_us_per_request": round(routed - direct, 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--policy", default="round_robin")
    p.add_argument("--requests", type=int, default=2000, help="per round")
    p.add_argument("--repeats", type=int, default=5, help="rounds; the best one counts")
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--api-key", default="sk-bench")
    p.add_argument("--prompt-tokens", type=int, default=0,
                   help="0: the fixed tiny body; N: N pseudo-tokens, half shared, half unique")
    p.add_argument("--kv-events", action="store_true",
                   help="the workers publish KV events and the router follows them "
                        "(implies --prompt-tokens 128 unless given)")
    p.add_argument("--floor", action="store_true",
                   help="a minimal aiohttp proxy instead of OmniProxy (what any router on this "
                        "stack pays)")
    p.add_argument("--output", type=Path, default=None, help="also write the result as JSON")
    args = p.parse_args()
    if args.kv_events and args.prompt_tokens <= 0:
        args.prompt_tokens = 128
    logging.basicConfig(level=logging.WARNING)
    try:
        import uvloop

        result = uvloop.run(run(args))
    except ImportError:
        result = asyncio.run(run(args))
    print(json.dumps(result))
    if args.output is not None:
        args.output.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
