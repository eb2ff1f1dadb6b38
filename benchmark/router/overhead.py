"""Router overhead: added latency (p50/p99) at a fixed request rate and max throughput, for
OmniProxy and the Rust sglang-router, in the same run against the same trivially fast workers.

The workers are a minimal in-script echo worker (TrivialEchoWorker: answers /generate at once
with a fixed tiny body, so nearly all time measured is HTTP + routing). Latency is measured
open-loop at --rate req/s: direct to a worker (the floor), then through each router; "added" is
router minus direct at the same percentile. Throughput: closed loop, --concurrency clients.

  python benchmark/router/overhead.py --rates 200,1000 --duration 5
  python benchmark/router/overhead.py --rates 1000 --api-key sk-x --policy oas \
      --targets direct,omniproxy --output /tmp/oas.json
With --api-key the workers require the key (as SGLang's server does), the routers are given it
(OmniProxy then also requires it of clients) and every client presents it.
Writes overhead.json and overhead.png beside this script and prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

HERE = Path(__file__).resolve().parent
BODY = {"text": "hello router", "sampling_params": {"max_new_tokens": 1}}


# ---- TrivialEchoWorker ------------------------------------------------------------------------
def serve_echo(port: int, api_key: str | None = None) -> None:
    """An SGLang-shaped worker that answers immediately (no model): the overhead floor."""
    from aiohttp import web

    answer = json.dumps({"text": "ok", "meta_info": {"id": "x", "completion_tokens": 1}}).encode()
    expected = f"Bearer {api_key}" if api_key else None

    async def gen(request: web.Request) -> web.Response:
        await request.read()
        if expected is not None and request.headers.get("Authorization") != expected:
            return web.Response(status=401, text="unauthorized")
        return web.Response(body=answer, content_type="application/json")

    async def info(_: web.Request) -> web.Response:
        return web.json_response({"model_path": "echo", "tokenizer_path": None,
                                  "is_generation": True, "max_total_num_tokens": 1 << 20})

    async def ok(_: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app.router.add_post("/generate", gen)
    for path in ("/model_info", "/get_model_info", "/server_info", "/get_server_info"):
        app.router.add_get(path, info)
    for path in ("/health", "/health_generate"):
        app.router.add_get(path, ok)
    app.router.add_get("/v1/models", lambda _: web.json_response({"data": [{"id": "echo"}]}))
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


# ---- processes --------------------------------------------------------------------------------
def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(command: list[str], ready_url: str, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as f:
        proc = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{command[:4]} exited: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(ready_url, timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        time.sleep(0.2)
    stop(proc)
    raise RuntimeError(f"{command[:4]} not ready: {log.read_text()[-2000:]}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(os.getpgid(proc.pid), signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(os.getpgid(proc.pid), signal.SIGKILL)
            proc.wait()


# ---- load -------------------------------------------------------------------------------------
HEADERS = {"Content-Type": "application/json"}


async def open_loop(url: str, rate: float, duration: float) -> tuple[list[float], int]:
    """Send at ``rate`` req/s for ``duration`` s; latency of each answered request (s)."""
    latencies: list[float] = []
    errors = 0
    payload = json.dumps(BODY).encode()
    headers = HEADERS
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def one() -> None:
            nonlocal errors
            t0 = time.perf_counter()
            try:
                async with session.post(url + "/generate", data=payload, headers=headers) as r:
                    await r.read()
                    if r.status != 200:
                        errors += 1
                        return
            except aiohttp.ClientError:
                errors += 1
                return
            latencies.append(time.perf_counter() - t0)

        for _ in range(200):  # warm the connection pools
            await one()
        latencies.clear()
        tasks = []
        start_t = time.perf_counter()
        n = int(rate * duration)
        for i in range(n):
            delay = start_t + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one()))
        await asyncio.gather(*tasks)
    return latencies, errors


async def closed_loop(url: str, concurrency: int, duration: float) -> float:
    done = 0
    payload = json.dumps(BODY).encode()
    headers = HEADERS
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        end = time.perf_counter() + duration

        async def client() -> None:
            nonlocal done
            while time.perf_counter() < end:
                async with session.post(url + "/generate", data=payload, headers=headers) as r:
                    await r.read()
                    done += r.status == 200

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return done / (time.perf_counter() - t0)


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rates", default="200,1000", help="open-loop rates (req/s), comma-separated")
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--policy", default="round_robin")
    p.add_argument("--output", type=Path, default=HERE / "overhead.json")
    p.add_argument("--api-key", default=None, help="workers require it, routers get it, "
                   "clients present it")
    p.add_argument("--targets", default="direct,omniproxy,sglang-router",
                   help="comma-separated subset of direct, omniproxy, sglang-router")
    p.add_argument("--serve-echo", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_echo:
        serve_echo(args.serve_echo, args.api_key)
        return 0
    key_args = ["--api-key", args.api_key] if args.api_key else []
    if args.api_key:
        HEADERS["Authorization"] = f"Bearer {args.api_key}"
    wanted = set(args.targets.split(","))
    logs = Path(tempfile.mkdtemp(prefix="router-overhead-"))  # process logs, kept on failure
    procs: list[subprocess.Popen[bytes]] = []
    rates = [float(r) for r in args.rates.split(",")]
    results: dict[str, Any] = {"rates": rates, "duration_s": args.duration,
                               "concurrency": args.concurrency, "workers": args.workers,
                               "policy": args.policy, "cpus": os.cpu_count(),
                               "api_key": bool(args.api_key), "runs": {}}
    try:
        urls = []
        for i in range(args.workers):
            port = free_port()
            procs.append(start([sys.executable, __file__, "--serve-echo", str(port), *key_args],
                               f"http://127.0.0.1:{port}/health", logs / f"echo{i}.log"))
            urls.append(f"http://127.0.0.1:{port}")
        targets: dict[str, list[str] | None] = {"direct": None}
        ours = free_port()
        targets["omniproxy"] = [sys.executable, "-m", "omniinfer.router", "--host", "127.0.0.1",
                                "--port", str(ours), "--worker-urls", *urls,
                                "--policy", args.policy, "--log-level", "warn",
                                "--max-concurrent-requests", "0", *key_args]
        rust = free_port()
        targets["sglang-router"] = [sys.executable, "-m", "sglang_router.launch_router",
                                    "--host", "127.0.0.1", "--port", str(rust),
                                    "--worker-urls", *urls, "--policy", args.policy,
                                    "--log-level", "warn", "--prometheus-port", str(free_port()),
                                    *key_args]
        targets = {k: v for k, v in targets.items() if k in wanted}
        ports = {"direct": None, "omniproxy": ours, "sglang-router": rust}
        curves: dict[str, list[float]] = {}
        for name, command in targets.items():
            url = urls[0] if command is None else f"http://127.0.0.1:{ports[name]}"
            proc = None
            if command is not None:
                proc = start(command, url + "/health", logs / f"{name}.log")
            try:
                for rate in rates:
                    lat, errors = asyncio.run(open_loop(url, rate, args.duration))
                    curves[f"{name} @ {rate:.0f}/s"] = lat
                    results["runs"][f"{name}@{rate:.0f}"] = {
                        "target": name, "rate": rate, "p50_ms": pct(lat, 0.5) * 1e3,
                        "p99_ms": pct(lat, 0.99) * 1e3, "answered": len(lat), "errors": errors}
                tput = asyncio.run(closed_loop(url, args.concurrency, args.duration))
                results.setdefault("max_throughput_rps", {})[name] = tput
            finally:
                if proc is not None:
                    stop(proc)
        for rate in rates:
            base = results["runs"].get(f"direct@{rate:.0f}")
            for name in ("omniproxy", "sglang-router"):
                run = results["runs"].get(f"{name}@{rate:.0f}")
                if base is None or run is None:
                    continue
                run["added_p50_ms"] = run["p50_ms"] - base["p50_ms"]
                run["added_p99_ms"] = run["p99_ms"] - base["p99_ms"]
                # a direct p99 far above a millisecond means the client machine itself saturated
                run["client_saturated"] = base["p99_ms"] > 20.0
        tp = results["max_throughput_rps"]
        if "omniproxy" in tp and "sglang-router" in tp:
            results["ratio_throughput_ours_over_rust"] = tp["omniproxy"] / max(
                1e-6, tp["sglang-router"])
    finally:
        for proc in procs:
            stop(proc)
    args.output.write_text(json.dumps(results, indent=2))
    print(f"Router overhead, open loop ({args.duration:.0f} s per rate), {args.workers} echo "
          f"workers, policy {args.policy}, {os.cpu_count()} CPUs")
    print(f"{'target':<15}{'req/s':>7}{'p50 ms':>10}{'p99 ms':>10}{'added p50':>11}"
          f"{'added p99':>11}{'errors':>8}")
    for run in results["runs"].values():
        note = "  (client saturated)" if run.get("client_saturated") else ""
        print(f"{run['target']:<15}{run['rate']:>7.0f}{run['p50_ms']:>10.3f}{run['p99_ms']:>10.3f}"
              f"{run.get('added_p50_ms', 0.0):>11.3f}{run.get('added_p99_ms', 0.0):>11.3f}"
              f"{run['errors']:>8}{note}")
    for name, value in results["max_throughput_rps"].items():
        print(f"max throughput {name:<14} {value:8.0f} req/s (closed loop, {args.concurrency} clients)")
    if "ratio_throughput_ours_over_rust" in results:
        print(f"max throughput ours / rust: {results['ratio_throughput_ours_over_rust']:.2f}x")
    _plot(curves, args.output.with_suffix(".png"))
    return 0


def _plot(curves: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, lat in curves.items():
        s = sorted(x * 1e3 for x in lat)
        if s:
            ax.plot(s, [(i + 1) / len(s) for i in range(len(s))], label=name)
    ax.set_xscale("log")
    ax.set_xlabel("request latency (ms)")
    ax.set_ylabel("CDF")
    ax.set_title("Latency through each router vs direct")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    raise SystemExit(main())
