"""Soak OmniProxy: N minutes of mixed traffic against emulated PD workers, with faults.

Traffic (open loop at --rate req/s): normal and streaming requests, clients that leave after
the first event, and bad inputs (deep nesting, huge numbers, wrong types, garbage). Faults every
--fault-every seconds: a worker killed and restarted on its port, or frozen (SIGSTOP) for a
while and thawed. With --attacks (the default) it also mixes in the attacks of ``attacks.py``:
large bodies under a short head timeout, a user key calling the admin routes, gzip bombs,
clients that never read their stream (each with what must hold: breaches must be 0, the write
deadline frees the slots). At the end it prints requests sent, faults injected, bad inputs tried,
requests lost (no answer, or a stream without its end: must be 0), 5xx answers to bad inputs
(must be 0), the router's RSS after warm-up and at the end, and the router's in-flight counters
once traffic stopped (must all be 0). Every --sample-every seconds it also records the router's
RSS beside its live Python heap (allocated blocks), its largest table (prefix-index blocks per
worker, each capped by --max-tree-size / --apc-block-size) and the requests in flight, prints
that series, writes it to the results and plots it (PNG beside the results). A leak grows the
live heap; RSS alone keeps the allocator's high-water mark (bursts of requests in flight while
a worker hangs, the index growing to its cap), so it may step up and then stays flat.

  python benchmark/router/soak.py --minutes 20 --rate 10
  python benchmark/router/soak.py --minutes 5 --max-tree-size 16384   # caps reached early

With --hostile it runs ``hostile.py`` instead: the router against a compromised worker
(``hostile_worker.py``: load-feed and KV-event floods, a huge page, resequencing, an endless
replay, endless and huge control answers, 1e308 loads, secrets at depth), checking /liveness p99
< 100 ms, RSS < 300 MiB, every request answered and no secret read; results in
soak_hostile.json / .png:

  python benchmark/router/soak.py --hostile                     # 30 s, all attacks at once
  python benchmark/router/soak.py --hostile --hostile-each --hostile-secs 10   # each, then all
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attacks import ADMIN_KEY, WEIGHTS, attack, router_flags  # noqa: E402
from hostile import add_arguments as add_hostile_arguments  # noqa: E402
from hostile import run as run_hostile  # noqa: E402

from omniinfer.child_process import free_port  # noqa: E402
from omniinfer.proxy.process import RouterProcess  # noqa: E402

HERE = Path(__file__).resolve().parent
KEY = "soak-key"
ATTACKS = False  # set from --attacks in main()


class Worker:
    """One ``python -m omniinfer.emulator`` that can be killed, restarted, frozen, thawed."""

    def __init__(self, mode: str, log_dir: Path) -> None:
        self.mode, self.port = mode, free_port()
        self.bootstrap = free_port() if mode == "prefill" else None
        self.command = [sys.executable, "-m", "omniinfer.emulator", "--profile", "cpu-smollm2",
                        "--port", str(self.port), "--time-scale", "0.02",
                        "--disaggregation-mode", mode]
        if self.bootstrap:
            self.command += ["--disaggregation-bootstrap-port", str(self.bootstrap)]
        self.log = log_dir / f"{mode}-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"emulator {self.mode} on {self.port} did not start")

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def stop(self) -> None:
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()


def _deep(depth: int) -> bytes:
    return b'{"text": "x", "extra": ' + b"[" * depth + b"]" * depth + b"}"


BAD = [_deep(300), _deep(2000), b'{"text": "x", "n": 1e999}', b'{"text": {"a": 1}}',
       b'{"input_ids": [1, "2"]}', b'{"text": "x", "stream": "yes"}', b"[1, 2]", b"\xff\xfe",
       b'{"text": "x", "sampling_params": {"max_new_tokens": 1e300}}',
       b'{"text": "x", "sampling_params": "many"}', b'{"messages": 3}', b""]


class Tally:
    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.lost: list[str] = []
        self.bad_5xx: list[str] = []
        self.breaches: list[str] = []  # an attack that got through

    def add(self, key: str) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1


async def one(session: aiohttp.ClientSession, base: str, kind: str, i: int, tally: Tally) -> None:
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    path = random.choice(["/generate", "/v1/completions", "/v1/chat/completions"])
    n = random.randint(1, 24)
    body: Any = {"/generate": {"text": f"soak {i} " * random.randint(1, 40),
                               "sampling_params": {"max_new_tokens": n}},
                 "/v1/completions": {"prompt": f"soak {i}", "max_tokens": n, "model": "m"},
                 "/v1/chat/completions": {"messages": [{"role": "user", "content": f"soak {i}"}],
                                          "max_tokens": n, "model": "m"}}[path]
    if kind == "bad":
        data = random.choice(BAD)
        path = random.choice(["/generate", "/v1/completions", "/v1/chat/completions"])
    else:
        body["stream"] = kind in ("stream", "leave")
        body["rid"] = random.choice(["a", "ab", f"c{i}"])  # rids that prefix each other
        data = json.dumps(body).encode()
    tally.add(f"sent_{kind}")
    try:
        async with session.post(base + path, data=data, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=180)) as resp:
            tally.add(f"status_{resp.status}")
            if kind == "bad":
                await resp.read()
                if resp.status >= 500:
                    tally.bad_5xx.append(f"{resp.status} {data[:60]!r}")
                return
            if kind == "leave":
                await resp.content.readline()
                return  # leaving: the context exit closes the connection mid-stream
            text = (await resp.read()).decode(errors="replace")
            if resp.status == 200 and body["stream"] and not text.rstrip().endswith("[DONE]"):
                tally.lost.append(f"stream without its end: {text[-120:]!r}")
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        tally.lost.append(f"{kind}: {exc.__class__.__name__}: {exc}")


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def admin_key() -> str:
    return ADMIN_KEY if ATTACKS else KEY


def describe(base: str) -> dict[str, Any]:
    req = urllib.request.Request(base + "/list_workers",
                                 headers={"Authorization": f"Bearer {admin_key()}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def counters(state: dict[str, Any]) -> dict[str, int]:
    """Everything that must be back to zero once no request is in flight."""
    out = {"admission_active": state["admission"]["active"],
           "admission_queued": state["admission"]["queued"]}
    for w in state["workers"]:
        out[f"{w['url']} inflight_requests"] = w["inflight_requests"]
        out[f"{w['url']} inflight_tokens"] = w["inflight_tokens"]
    for role, policy in (state.get("policy_state") or {}).items():
        out[f"{role} policy queued"] = policy.get("queued", 0)
        for url, inst in (policy.get("instances") or {}).items():
            out[f"{role} {url} booked"] = inst.get("sent", 0)
    return out


def index_blocks(state: dict[str, Any]) -> int:
    """Blocks in the router's prefix indexes, all roles and workers."""
    index = state.get("tables", {}).get("prefix_index", {})
    return sum(sum(role["blocks"].values()) for role in index.values())


def point(state: dict[str, Any], t_s: float | None, rss: int) -> dict[str, Any]:
    """One point of the memory series from a /list_workers answer."""
    tables = state.get("tables", {})
    return {"t_s": t_s, "rss_kib": rss, "prefix_blocks": index_blocks(state),
            "python_blocks": tables.get("python_allocated_blocks"),
            "in_flight": state["admission"]["active"],
            "open_connections": (state.get("connections") or {}).get("open"),
            "background_tasks": tables.get("background_tasks"),
            "metric_series": tables.get("metric_series")}


async def sample(session: aiohttp.ClientSession, base: str, pid: int, start: float,
                 series: list[dict[str, Any]]) -> None:
    """One point of the memory series: RSS beside the router's table sizes and live heap."""
    try:
        async with session.get(base + "/list_workers",
                               headers={"Authorization": f"Bearer {admin_key()}"},
                               timeout=aiohttp.ClientTimeout(total=10)) as resp:
            state = await resp.json()
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return
    series.append(point(state, round(time.monotonic() - start, 1), rss_kib(pid)))


async def traffic(base: str, workers: list[Worker], args: argparse.Namespace,
                  tally: Tally, router_pid: int, rss: dict[str, int],
                  series: list[dict[str, Any]]) -> None:
    kinds = ["normal"] * 45 + ["stream"] * 25 + ["leave"] * 10 + ["bad"] * 20
    if args.attacks:
        kinds += [kind for kind, weight in WEIGHTS.items() for _ in range(weight)]
    duration = args.minutes * 60
    warmup = min(120.0, duration * 0.1)
    start = time.monotonic()
    next_fault = start + args.fault_every
    next_sample = start
    tasks: set[asyncio.Task[None]] = set()
    i = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        while (now := time.monotonic()) - start < duration:
            if "warm" not in rss and now - start >= warmup:
                rss["warm"] = rss_kib(router_pid)
            if now >= next_sample:
                next_sample = now + args.sample_every
                task = asyncio.create_task(sample(session, base, router_pid, start, series))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if now >= next_fault:
                next_fault = now + args.fault_every
                asyncio.get_running_loop().run_in_executor(None, fault, workers, tally)
            kind = random.choice(kinds)
            task = asyncio.create_task(attack(kind, session, base, KEY, tally) if kind in WEIGHTS
                                       else one(session, base, kind, i, tally))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            i += 1
            await asyncio.sleep(random.expovariate(args.rate))
        await asyncio.gather(*tasks)


def fault(workers: list[Worker], tally: Tally) -> None:
    victim = random.choice(workers)
    if random.random() < 0.5:
        tally.add(f"fault_kill_{victim.mode}")
        victim.stop()
        time.sleep(3.0)
        victim.start()
    else:
        tally.add(f"fault_hang_{victim.mode}")
        victim.signal(signal.SIGSTOP)
        time.sleep(8.0)
        victim.signal(signal.SIGCONT)


def growth(series: list[dict[str, Any]], duration_s: float) -> dict[str, Any]:
    """Memory after warm-up (the first tenth of the run, at most 2 min): RSS and the live
    Python heap (allocated blocks) at its start, half-way and at the end, and the prefix
    index's peak. A leak grows the live heap; the allocator keeps RSS at its high-water mark
    (a burst of in-flight requests during a fault, the index growing to its cap)."""
    warm = min(120.0, duration_s * 0.1)
    points = [p for p in series if p["t_s"] is not None and p["t_s"] >= warm]
    if len(points) < 3:
        return {}
    first, middle, last = points[0], points[len(points) // 2], points[-1]
    return {"after_s": warm,
            "rss_kib": [first["rss_kib"], middle["rss_kib"], last["rss_kib"]],
            "rss_growth_kib": last["rss_kib"] - first["rss_kib"],
            "rss_growth_second_half_kib": last["rss_kib"] - middle["rss_kib"],
            "python_blocks": [first["python_blocks"], middle["python_blocks"],
                              last["python_blocks"]],
            "prefix_blocks_peak": max(p["prefix_blocks"] for p in points),
            "prefix_blocks_end": last["prefix_blocks"],
            "in_flight_peak": max(p["in_flight"] for p in points)}


def plot(series: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [p for p in series if p["t_s"] is not None]
    if not points:
        return
    t = [p["t_s"] / 60 for p in points]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True)
    top.plot(t, [p["rss_kib"] / 1024 for p in points], color="tab:blue", label="RSS (MiB)")
    top.set_ylabel("RSS (MiB)", color="tab:blue")
    heap = top.twinx()
    heap.plot(t, [p["python_blocks"] / 1000 for p in points], color="tab:green")
    heap.set_ylabel("live Python blocks (K)", color="tab:green")
    top.set_title("OmniProxy soak: RSS, live heap, prefix index, requests in flight")
    bottom.plot(t, [p["prefix_blocks"] for p in points], color="tab:orange")
    bottom.set_ylabel("prefix-index blocks", color="tab:orange")
    bottom.set_xlabel("minutes")
    flight = bottom.twinx()
    flight.plot(t, [p["in_flight"] for p in points], color="tab:red", linewidth=0.8)
    flight.set_ylabel("requests in flight", color="tab:red")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--rate", type=float, default=10.0, help="requests per second")
    ap.add_argument("--fault-every", type=float, default=30.0, help="seconds between faults")
    ap.add_argument("--policy", default="oas", help="prefill and decode policy")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sample-every", type=float, default=10.0,
                    help="seconds between two points of the RSS / table-size series")
    ap.add_argument("--max-tree-size", type=int, default=None,
                    help="the router's prefix-index cap in tokens per worker (default: its own)")
    ap.add_argument("--attacks", action=argparse.BooleanOptionalAction, default=True,
                    help="mix in the attacks of attacks.py (--no-attacks: plain traffic)")
    ap.add_argument("--out", help="results JSON (default soak.json, or soak_hostile.json)")
    add_hostile_arguments(ap)
    args = ap.parse_args()
    args.out = args.out or str(HERE / ("soak_hostile.json" if args.hostile else "soak.json"))
    if args.hostile:
        return run_hostile(args)
    global ATTACKS
    ATTACKS = args.attacks
    random.seed(args.seed)
    log_dir = Path(tempfile.mkdtemp(prefix="omniproxy-soak-"))
    workers = [Worker("prefill", log_dir), Worker("prefill", log_dir), Worker("decode", log_dir)]
    tally, rss = Tally(), {}
    series: list[dict[str, Any]] = []
    try:
        for w in workers:
            w.start()
        router_args = ["--pd-disaggregation", "--prefill-policy", args.policy,
                       "--decode-policy", args.policy, "--api-key", KEY,
                       "--health-check-interval-secs", "1", "--request-timeout-secs", "30",
                       "--upstream-first-byte-timeout-secs", "15",
                       "--upstream-idle-timeout-secs", "10", "--log-level", "warn",
                       "--access-log", str(log_dir / "access.jsonl")]
        if args.max_tree_size:
            router_args += ["--max-tree-size", str(args.max_tree_size)]
        if args.attacks:
            router_args += router_flags()
        for w in workers:
            router_args += (["--prefill", w.url, str(w.bootstrap)] if w.mode == "prefill"
                            else ["--decode", w.url])
        with RouterProcess(router_args, log_dir / "router.log") as router:
            assert router.process is not None
            pid = router.process.pid
            rss["start"] = rss_kib(pid)
            asyncio.run(traffic(router.base_url, workers, args, tally, pid, rss, series))
            for w in workers:  # faults over: every worker back before the final reading
                w.signal(signal.SIGCONT)
            deadline = time.monotonic() + 60
            while True:
                left = counters(describe(router.base_url))
                if not any(left.values()) or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            rss["end"] = rss_kib(pid)
            final = describe(router.base_url)
            series.append(point(final, None, rss["end"]))
    finally:
        for w in workers:
            w.stop()
    sent = sum(v for k, v in tally.counts.items() if k.startswith("sent_"))
    summary = {"minutes": args.minutes, "rate": args.rate, "policy": args.policy,
               "requests_sent": sent, "bad_inputs_tried": tally.counts.get("sent_bad", 0),
               "faults_injected": sum(v for k, v in tally.counts.items()
                                      if k.startswith("fault_")),
               "requests_lost": len(tally.lost), "bad_input_5xx": len(tally.bad_5xx),
               "attacks": args.attacks, "breaches": len(tally.breaches),
               "breach_examples": tally.breaches[:10],
               "router_guards": final.get("connections"),
               "router_rss_peak_kib": max((p["rss_kib"] for p in series), default=0),
               "router_rss_kib": rss, "memory": growth(series, args.minutes * 60),
               "rss_series": series, "prefix_index_at_end": final["tables"]["prefix_index"],
               "inflight_at_end": {k: v for k, v in left.items() if v},
               "counts": dict(sorted(tally.counts.items())), "lost_examples": tally.lost[:10],
               "bad_5xx_examples": tally.bad_5xx[:10]}
    Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items()
                      if k not in ("counts", "rss_series", "prefix_index_at_end")}, indent=1))
    print("memory series (s: RSS MiB / live Python blocks / prefix-index blocks / in flight):",
          ", ".join(f"{p['t_s']}: {p['rss_kib'] / 1024:.1f} / {p['python_blocks']} / "
                    f"{p['prefix_blocks']} / {p['in_flight']}" for p in series))
    plot(series, Path(args.out).with_suffix(".png"))
    print("counts:", summary["counts"])
    print("process logs:", log_dir)
    ok = not (tally.lost or tally.bad_5xx or tally.breaches or summary["inflight_at_end"])
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
