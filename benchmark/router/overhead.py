"""Router overhead: added latency (p50/p99) at a fixed request rate and max throughput, for
OmniProxy and a Rust router (--peer: smg 1.13, target smg; or sglang-router 0.3.2, target
sglang-router) against the same trivially fast workers, in one run. Beside smg both poll loads
every --poll-secs (its --load-monitor-interval, OmniProxy's --loads-poll-interval-secs).

The workers are a minimal in-script echo worker (TrivialEchoWorker: answers /generate at once
with a fixed tiny body, so nearly all time measured is HTTP + routing). Latency is measured
open-loop at --rate req/s: direct to a worker (the floor), then through each router; "added" is
router minus direct at the same percentile. Throughput: closed loop, --concurrency clients.
The router's CPU time per request (user + system, all threads) barely moves with other jobs.

  python benchmark/router/overhead.py --rates 200,1000 --duration 5
  python benchmark/router/overhead.py --rates 1000 --api-key sk-x --repeats 5 \
      --baseline-tree /path/to/older/checkout   # that checkout's router as a fourth target
  python benchmark/router/overhead.py --rates 1000 --api-key sk-x --policy oas --repeats 5
  python benchmark/router/overhead.py --peer sglang-router   # or --targets ...,smg,sglang-router
--repeats N: every target N times in turn (a fresh router each round), medians; the added latency
is the median over rounds of router minus the same round's direct run. With --api-key workers
require the key (as SGLang's server does), routers are given it (OmniProxy then requires it of
clients) and clients present it. With --kv-events each echo worker publishes KV events as SGLang
does (a warm cache under churn: every prompt stores its unique half, evicts the oldest one) and
OmniProxy follows them (--cache-truth kv-events). Writes overhead.json and .png beside this
script (or --output); prints the table."""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import psutil
from tqdm import tqdm

from omniinfer.child_process import free_port

HERE = Path(__file__).resolve().parent
BODY = {"text": "hello router", "sampling_params": {"max_new_tokens": 1}}


# ---- TrivialEchoWorker ------------------------------------------------------------------------
class EchoCache:
    """The KV events of a worker whose radix cache holds one shared prefix plus the unique tails
    of the last ``capacity`` prompts: each new prompt stores its tail (one ``BlockStored``) and,
    once full, evicts the oldest (one ``BlockRemoved``) -- a warm cache under churn."""

    def __init__(self, publisher: Any, shared_tokens: int, capacity: int = 1024) -> None:
        from omniinfer.proxy.tokenization import ApproxTokenizer

        self.recorder = publisher.recorder
        self.encode = ApproxTokenizer().encode  # the router's tokens (no --tokenizer-path)
        self.shared_tokens = shared_tokens
        self.capacity = capacity
        self.prefix: tuple[int, ...] | None = None
        self.prefix_hash: int | None = None
        self.tails: collections.deque[list[int]] = collections.deque()

    def on_prompt(self, text: str) -> None:
        tokens = self.encode(text)
        head, tail = tuple(tokens[:self.shared_tokens]), tokens[self.shared_tokens:]
        if head != self.prefix:  # the first prompt (or another prefix): store it under the root
            self.prefix, self.prefix_hash = head, self.recorder.stored(None, head)
        if tail:
            self.recorder.stored(self.prefix_hash, tail)
            self.tails.append(tail)
        if len(self.tails) > self.capacity:
            self.recorder.removed(self.prefix_hash, self.tails.popleft())


def echo_app(api_key: str | None = None, kv_port: int | None = None,
             shared_tokens: int = 0) -> Any:
    """An SGLang-shaped worker that answers immediately (no model): the overhead floor. With
    ``kv_port`` it also publishes KV events (``EchoCache``) on ``tcp://127.0.0.1:kv_port``."""
    from aiohttp import web

    answer = json.dumps({"text": "ok", "meta_info": {"id": "x", "completion_tokens": 1}}).encode()
    expected = f"Bearer {api_key}" if api_key else None
    info_body: dict[str, Any] = {"model_path": "echo", "tokenizer_path": None,
                                 "is_generation": True, "max_total_num_tokens": 1 << 20}
    cache: EchoCache | None = None
    publisher: Any = None
    if kv_port is not None:
        from omniinfer.emulator.kv_event_publisher import ZmqKvEventPublisher
        from omniinfer.kv_event_wire import parse_kv_events_config

        raw = json.dumps({"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{kv_port}",
                          "bind": True})
        publisher = ZmqKvEventPublisher(parse_kv_events_config(raw))
        cache = EchoCache(publisher, shared_tokens)
        info_body.update(kv_events_config=raw, page_size=1, dp_size=1)

    async def gen(request: web.Request) -> web.Response:
        raw_body = await request.read()
        if expected is not None and request.headers.get("Authorization") != expected:
            return web.Response(status=401, text="unauthorized")
        if cache is not None:
            cache.on_prompt(json.loads(raw_body)["text"])
        return web.Response(body=answer, content_type="application/json")

    async def info(_: web.Request) -> web.Response:
        return web.json_response(info_body)

    async def ok(_: web.Request) -> web.Response:
        return web.Response(text="")

    async def open_publisher(_: web.Application) -> None:
        publisher.start()

    async def close_publisher(_: web.Application) -> None:
        await publisher.close()

    app = web.Application()
    if publisher is not None:
        app.on_startup.append(open_publisher)
        app.on_cleanup.append(close_publisher)
    app.router.add_post("/generate", gen)
    for path in ("/model_info", "/get_model_info", "/server_info", "/get_server_info",
                 "/health", "/health_generate"):
        app.router.add_get(path, ok if path.startswith("/health") else info)
    app.router.add_get("/v1/models", lambda _: web.json_response({"data": [{"id": "echo"}]}))
    return app


def serve_echo(port: int, api_key: str | None = None, kv_port: int | None = None,
               shared_tokens: int = 0) -> None:
    """Run ``echo_app`` as its own process (on uvloop when installed)."""
    from aiohttp import web

    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    web.run_app(echo_app(api_key, kv_port, shared_tokens), host="127.0.0.1", port=port,
                print=None, access_log=None)


# ---- processes --------------------------------------------------------------------------------
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


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and its live children, all their threads (a router
    launcher may run the router in a child)."""
    process = psutil.Process(pid)
    total = 0.0
    for p in (process, *process.children(recursive=True)):
        with contextlib.suppress(psutil.NoSuchProcess):
            times = p.cpu_times()
            total += times.user + times.system
    return total


def wait_kv_subscribed(base: str, deadline_s: float = 30.0) -> None:
    """Until the router's KV-event subscription of every worker is connected (events published
    before it would be lost, leaving the router an orphan chain that costs it nothing)."""
    headers = {k: v for k, v in HEADERS.items() if k == "Authorization"}
    deadline = time.monotonic() + deadline_s
    while True:
        req = urllib.request.Request(base + "/list_workers", headers=headers)
        with urllib.request.urlopen(req, timeout=5) as r:
            workers = json.loads(r.read())["cache_truth"]["workers"]
        sources = [s for w in workers.values() for s in w.get("sources", [])]
        if sources and all(s["connected"] for s in sources) and \
                all(w.get("cache_truth") == "kv-events" for w in workers.values()):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"KV events not subscribed: {workers}")
        time.sleep(0.1)


# ---- load -------------------------------------------------------------------------------------
HEADERS = {"Content-Type": "application/json"}
BASE = ("random", "round_robin", "cache_aware", "power_of_two")  # sglang-router 0.3.2's policies
# the Rust routers (--peer): module, and its policies that apply here (the rest: cache_aware)
PEERS = {"smg": ("smg.launch_router", (*BASE, "least_load", "consistent_hashing", "prefix_hash")),
         "sglang-router": ("sglang_router.launch_router", BASE)}
WARM_BURST = 32  # concurrent requests in each warm-up burst


def payloads(count: int, prompt_tokens: int) -> list[bytes]:
    """Request bodies: the fixed tiny one, or ``prompt_tokens`` pseudo-tokens (4 bytes each) of
    which the first half is shared by all and the second half unique to each request."""
    if prompt_tokens <= 0:
        return [json.dumps(BODY).encode()] * count
    half = prompt_tokens // 2
    shared = ("shared prefix " * prompt_tokens)[:4 * half]
    out = []
    for i in range(count):
        tail = (f"{i:012d} " * prompt_tokens)[:4 * (prompt_tokens - half)]
        out.append(json.dumps({**BODY, "text": shared + tail}).encode())
    return out


async def open_loop(url: str, rate: float, duration: float, prompt_tokens: int, pid: int
                    ) -> tuple[list[float], int, float]:
    """Send at ``rate`` req/s for ``duration`` s: latency of each answered request (s), errors,
    and the CPU seconds process ``pid`` spent from the end of the warm-up to the last answer."""
    latencies: list[float] = []
    errors = 0
    warm, n = 200, int(rate * duration)
    bodies = payloads(warm + n, prompt_tokens)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(payload: bytes) -> None:
            nonlocal errors
            t0 = time.perf_counter()
            try:
                async with session.post(url + "/generate", data=payload, headers=HEADERS) as r:
                    await r.read()
                    if r.status != 200:
                        errors += 1
                        return
            except aiohttp.ClientError:
                errors += 1
                return
            latencies.append(time.perf_counter() - t0)

        # warm up, then open the connection pools a burst needs (client -> router -> workers):
        # a connection opened mid-run would be charged to the requests that waited for it
        for i in range(warm - WARM_BURST * 3):
            await one(bodies[i])
        for k in range(3):
            start = warm - WARM_BURST * (3 - k)
            await asyncio.gather(*(one(bodies[start + j]) for j in range(WARM_BURST)))
        latencies.clear()
        errors = 0
        cpu_start = cpu_seconds(pid)
        tasks = []
        start_t = time.perf_counter()
        for i in range(n):
            delay = start_t + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one(bodies[warm + i])))
        await asyncio.gather(*tasks)
    return latencies, errors, cpu_seconds(pid) - cpu_start


async def closed_loop(url: str, concurrency: int, duration: float, prompt_tokens: int
                      ) -> tuple[float, int]:
    """Requests per second with ``concurrency`` clients back to back, and requests answered."""
    done = 0
    bodies = payloads(4096, prompt_tokens)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        end = time.perf_counter() + duration

        async def client(k: int) -> None:
            nonlocal done
            i = k
            while time.perf_counter() < end:
                async with session.post(url + "/generate", data=bodies[i % len(bodies)],
                                        headers=HEADERS) as r:
                    await r.read()
                    done += r.status == 200
                i += concurrency

        t0 = time.perf_counter()
        await asyncio.gather(*(client(k) for k in range(concurrency)))
        return done / (time.perf_counter() - t0), done


def run_loop(coro: Any) -> Any:
    """Run the client on uvloop when installed: the load generator shares the machine with the
    router, and the default loop's extra CPU per request would be charged to the router's p99."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def peer_policy(peer: str, policy: str) -> str:
    return policy if policy in PEERS[peer][1] else "cache_aware"


def router_command(name: str, urls: list[str], port: int, args: argparse.Namespace,
                   extra: list[str]) -> list[str]:
    """Target ``name`` over ``urls``: a Rust router (smg polling loads every --poll-secs), or
    OmniProxy (omniproxy-baseline: from --baseline-tree; beside smg polling at smg's rate)."""
    if name in PEERS:
        poll = ["--load-monitor-interval", str(args.poll_secs)] if name == "smg" else []
        return [sys.executable, "-m", PEERS[name][0], "--host", "127.0.0.1", "--port", str(port),
                "--worker-urls", *urls, "--policy", peer_policy(name, args.policy), "--log-level",
                "warn", "--prometheus-port", str(free_port()), *poll, *extra]  # 29000 clashes
    poll = ["--loads-poll-interval-secs", str(args.poll_secs)] if args.peer == "smg" else []
    truth = ["--cache-truth", "kv-events"] if args.kv_events else []
    old = ["env", f"PYTHONPATH={args.baseline_tree.resolve() / 'python'}"] if name.endswith(
        "-baseline") else []
    return [*old, sys.executable, "-m", "omniinfer.router", "--host", "127.0.0.1", "--port",
            str(port), "--worker-urls", *urls, "--policy", args.policy, "--log-level", "warn",
            "--max-concurrent-requests", "0", *poll, *truth, *extra]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rates", default="200,1000", help="open-loop rates (req/s), comma-separated")
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--repeats", type=int, default=1, help="rounds of every target in turn: "
                   "medians; added latency: median of each round's router minus its direct")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--policy", default="round_robin")
    p.add_argument("--output", type=Path, default=HERE / "overhead.json")
    p.add_argument("--api-key", default=None, help="workers require it, routers get it, "
                   "clients present it")
    p.add_argument("--peer", choices=PEERS, default="smg", help="the Rust router (target name)")
    p.add_argument("--poll-secs", type=int, default=1,
                   help="with smg: both routers' load poll (sglang-router: OmniProxy's default)")
    p.add_argument("--targets", default=None, help="comma-separated subset of direct, "
                   "omniproxy, smg, sglang-router (default: direct, omniproxy and --peer)")
    p.add_argument("--prompt-tokens", type=int, default=0,
                   help="0: the fixed tiny body; N: N pseudo-tokens, half shared, half unique")
    p.add_argument("--kv-events", action="store_true", help="workers publish KV events; "
                   "OmniProxy runs --cache-truth kv-events (implies --prompt-tokens 128)")
    p.add_argument("--no-throughput", action="store_true", help="skip the closed-loop phase")
    p.add_argument("--baseline-tree", type=Path, default=None,
                   help="another checkout: its router runs as target omniproxy-baseline")
    p.add_argument("--serve-echo", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--kv-port", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.poll_secs < 1:
        p.error("--poll-secs: smg's --load-monitor-interval is whole seconds, at least 1")
    if args.serve_echo:
        serve_echo(args.serve_echo, args.api_key, args.kv_port, args.prompt_tokens // 2)
        return 0
    if args.kv_events and args.prompt_tokens <= 0:
        args.prompt_tokens = 128
    key_args = ["--api-key", args.api_key] if args.api_key else []
    if args.api_key:
        HEADERS["Authorization"] = f"Bearer {args.api_key}"
    wanted = set((args.targets or f"direct,omniproxy,{args.peer}").split(","))
    logs = Path(tempfile.mkdtemp(prefix="router-overhead-"))  # process logs, kept on failure
    procs: list[subprocess.Popen[bytes]] = []
    rates = [float(r) for r in args.rates.split(",")]
    results: dict[str, Any] = {
        "rates": rates, "duration_s": args.duration, "cpus": os.cpu_count(),
        **{k: vars(args)[k] for k in ("repeats", "concurrency", "workers", "policy", "peer",
                                      "kv_events", "prompt_tokens")},
        "peer_policy": peer_policy(args.peer, args.policy), "api_key": bool(args.api_key),
        "poll_secs": args.poll_secs if args.peer == "smg" else None, "runs": {}}
    try:
        urls = []
        for i in range(args.workers):
            port = free_port()
            extra = ["--kv-port", str(free_port())] if args.kv_events else []
            procs.append(start([sys.executable, __file__, "--serve-echo", str(port), *key_args,
                                "--prompt-tokens", str(args.prompt_tokens), *extra],
                               f"http://127.0.0.1:{port}/health", logs / f"echo{i}.log"))
            urls.append(f"http://127.0.0.1:{port}")
        if args.baseline_tree is not None:
            wanted.add("omniproxy-baseline")
        ports = {name: free_port() for name in ("omniproxy", "omniproxy-baseline", *PEERS)
                 if name in wanted}  # run in this order, after direct
        targets: dict[str, list[str] | None] = {"direct": None} if "direct" in wanted else {}
        targets.update({name: router_command(name, urls, port, args, key_args)
                        for name, port in ports.items()})
        curves: dict[str, list[float]] = {}
        samples: dict[str, list[dict[str, float]]] = {}
        for rep in tqdm(range(args.repeats), desc="rounds", disable=args.repeats == 1):
            for name, command in targets.items():
                url = urls[0] if command is None else f"http://127.0.0.1:{ports[name]}"
                proc = start(command, url + "/health", logs / f"{name}.log") if command else None
                if proc is not None and args.kv_events and name == "omniproxy":
                    wait_kv_subscribed(url)
                pid = (proc or procs[0]).pid  # direct: the echo worker's own CPU (the floor)
                try:
                    for rate in rates:
                        lat, errors, cpu = run_loop(open_loop(url, rate, args.duration,
                                                              args.prompt_tokens, pid))
                        sent = int(rate * args.duration)
                        curves.setdefault(f"{name} @ {rate:.0f}/s", []).extend(lat)
                        samples.setdefault(f"{name}@{rate:.0f}", []).append({
                            "p50_ms": pct(lat, 0.5) * 1e3, "p99_ms": pct(lat, 0.99) * 1e3,
                            "answered": len(lat), "errors": errors,
                            "cpu_ms_per_request": cpu / max(1, sent) * 1e3})
                    if rep == 0 and not args.no_throughput:
                        before = cpu_seconds(pid)
                        tput, done = run_loop(closed_loop(url, args.concurrency, args.duration,
                                                          args.prompt_tokens))
                        results.setdefault("max_throughput_rps", {})[name] = tput
                        results.setdefault("throughput_cpu_ms_per_request", {})[name] = (
                            (cpu_seconds(pid) - before) / max(1, done) * 1e3)
                finally:
                    if proc is not None:
                        stop(proc)
        for key, rounds in samples.items():
            name, rate_text = key.split("@")
            results["runs"][key] = {
                "target": name, "rate": float(rate_text),
                **{k: statistics.median(r[k] for r in rounds)
                   for k in ("p50_ms", "p99_ms", "cpu_ms_per_request")},
                "answered": sum(r["answered"] for r in rounds),
                "errors": sum(r["errors"] for r in rounds),
                "p99_ms_rounds": [round(r["p99_ms"], 4) for r in rounds]}
        for rate in rates:
            base = samples.get(f"direct@{rate:.0f}")
            for name in ("omniproxy", "omniproxy-baseline", *PEERS):
                rounds = samples.get(f"{name}@{rate:.0f}")
                if base is None or rounds is None:
                    continue
                run = results["runs"][f"{name}@{rate:.0f}"]
                # each round against the direct run of the same round, then the median
                for q in ("p50", "p99"):
                    added = [r[f"{q}_ms"] - b[f"{q}_ms"] for r, b in zip(rounds, base, strict=True)]
                    run[f"added_{q}_ms"] = statistics.median(added)
                    run[f"added_{q}_ms_rounds"] = [round(a, 4) for a in added]
                # a direct p99 far above a millisecond means the client machine itself saturated
                run["client_saturated"] = results["runs"][f"direct@{rate:.0f}"]["p99_ms"] > 20.0
        tp = results.get("max_throughput_rps", {})
        if "omniproxy" in tp and args.peer in tp:  # ours over the peer's
            results["ratio_throughput_ours_over_rust"] = tp["omniproxy"] / max(1e-6, tp[args.peer])
    finally:
        for proc in procs:
            stop(proc)
    args.output.write_text(json.dumps(results, indent=2))
    print(f"Router overhead, open loop ({args.duration:.0f} s per rate, median of {args.repeats} "
          f"round(s)), {args.workers} echo workers, policy {args.policy} ({args.peer}: "
          f"{results['peer_policy']}), {os.cpu_count()} CPUs{', KV events' * args.kv_events}"
          f"{f', {args.prompt_tokens}-token prompts' if args.prompt_tokens else ''}")
    print(f"{'target':<20}{'req/s':>7}{'p50 ms':>10}{'p99 ms':>10}{'added p50':>11}"
          f"{'added p99':>11}{'cpu ms/req':>12}{'errors':>8}")
    for run in results["runs"].values():
        note = "  (client saturated)" if run.get("client_saturated") else ""
        print(f"{run['target']:<20}{run['rate']:>7.0f}{run['p50_ms']:>10.3f}{run['p99_ms']:>10.3f}"
              f"{run.get('added_p50_ms', 0.0):>11.3f}{run.get('added_p99_ms', 0.0):>11.3f}"
              f"{run['cpu_ms_per_request']:>12.3f}{run['errors']:>8}{note}")
    print("cpu ms/req: the router's CPU time (user + system, all threads and child processes) "
          "per request sent; for direct, the echo worker's")
    for name, value in results.get("max_throughput_rps", {}).items():
        cpu = results["throughput_cpu_ms_per_request"][name]
        print(f"max throughput {name:<14} {value:8.0f} req/s (closed loop, {args.concurrency} "
              f"clients; {cpu:.3f} cpu ms/req)")
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
    ax.set(xscale="log", xlabel="request latency (ms)", ylabel="CDF",
           title="Latency through each router vs direct")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    raise SystemExit(main())
