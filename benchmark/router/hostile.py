"""``soak.py --hostile``: the router against a compromised worker (``hostile_worker.py``).

One router (regular mode, ``--cache-truth kv-events``, ``--load-feed auto``, ``--api-key`` and a
user and an admin control-plane key) with two workers: the hostile one (listed first, so the
router's relayed ``/server_info``, ``/model_info``, ``/v1/models`` try it first) and an honest
emulator. Once the router follows the hostile worker's KV events and load feed (a calm phase,
which also reads the control routes with the user key), the hostile worker is armed and attacks
for ``--hostile-secs`` (all attacks at once; ``--hostile-each``: each attack alone in turn, then
all; each phase's figures include the 2 s after it). Throughout: ``/liveness`` every 50 ms from its own thread, the router's RSS every 100 ms
(``VmRSS``; above ``--rss-guard-mib`` the router is killed to protect the host), a steady stream
of ``/generate`` requests through the router (plain and streamed; every one must be answered,
by either worker), and two clients reading ``/server_info``, ``/model_info``, ``/v1/models``,
``/health_generate`` with the user key. A phase passes when ``/liveness`` p99 < 100 ms with no
probe failed, RSS < 300 MiB, no request failed, and no secret was read: neither a value the
hostile worker planted (they contain ``MARKER``) nor a non-empty field whose name has the word
key, secret, password, token or credential at any depth. Prints a table, writes the results
JSON and a PNG (liveness latency and RSS over time), exits 1 if any phase failed.

  python benchmark/router/soak.py --hostile                      # 30 s, all attacks at once
  python benchmark/router/soak.py --hostile --hostile-each --hostile-secs 10   # per attack
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
from attacks import ADMIN_KEY, USER_KEY
from hostile_worker import ATTACKS, HOSTILE_TEXT, MARKER

from omniinfer.child_process import ManagedProcess, free_port
from omniinfer.proxy.process import RouterProcess

HERE = Path(__file__).resolve().parent
KEY = "soak-key"
LIVENESS_P99_MS, RSS_LIMIT_MIB = 100.0, 300.0
PROBE_TIMEOUT_S = 5.0
READ_CAP = 16 << 20  # the prober reads at most this much of an answer
CONTROL = ("/server_info", "/model_info", "/v1/models", "/health_generate")
SECRET_WORDS = frozenset({"key", "apikey", "secret", "password", "passwd", "token",
                          "credential", "credentials"})


def add_arguments(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("hostile worker (--hostile)")
    g.add_argument("--hostile", action="store_true",
                   help="instead of the soak: the router against a hostile worker")
    g.add_argument("--hostile-secs", type=float, default=30.0, help="seconds per attack phase")
    g.add_argument("--hostile-attacks", default=",".join(ATTACKS),
                   help=f"comma-separated, from: {', '.join(ATTACKS)}")
    g.add_argument("--hostile-each", action="store_true",
                   help="one phase per attack, then one with all")
    g.add_argument("--hostile-rate", type=float, default=5.0, help="honest requests per second")
    g.add_argument("--calm-secs", type=float, default=5.0, help="baseline before the attacks")
    g.add_argument("--rss-guard-mib", type=float, default=2048.0,
                   help="kill the router above this RSS (protects the host)")


def rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def spawn(command: list[str], port: int, log: Path) -> ManagedProcess:
    """A worker in its own process group (the package's one child-process helper), once its
    ``/health`` answers 200."""
    return ManagedProcess(command, None, log, port, ready_timeout_s=60.0, kind="worker").start()


def words(name: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower())


PLACEHOLDER = re.compile(r"^[\W_]*(redacted|hidden|masked)?[\W_]*$", re.IGNORECASE)


def revealing(value: Any) -> bool:
    """A value that may show a secret: not empty, no number, no placeholder ("<redacted>")."""
    if isinstance(value, str):
        return not PLACEHOLDER.match(value)
    return not isinstance(value, (int, float, bool)) and value not in (None, [], {})


def secret_fields(obj: Any) -> list[str]:
    """JSON paths of revealing fields whose name has a secret word (at any depth)."""
    found, stack = [], [("$", obj)]
    while stack:
        path, node = stack.pop()
        items = node.items() if isinstance(node, dict) else \
            enumerate(node) if isinstance(node, list) else ()
        for k, v in items:
            sub = f"{path}.{k}" if isinstance(k, str) else f"{path}[{k}]"
            if isinstance(k, str) and SECRET_WORDS & set(words(k)) and revealing(v):
                found.append(sub)
            stack.append((sub, v))
    return found


class Sampler:
    """Two threads: ``/liveness`` every 50 ms on a kept-alive connection, RSS every 100 ms."""

    def __init__(self, port: int, pid: int, t0: float, guard_kib: int) -> None:
        self.port, self.pid, self.t0, self.guard_kib = port, pid, t0, guard_kib
        self.live: list[tuple[float, float, bool]] = []  # (t_s, ms, answered 200)
        self.rss: list[tuple[float, int]] = []  # (t_s, KiB)
        self.killed_at: float | None = None
        self.stopped = threading.Event()
        self.threads = [threading.Thread(target=f, daemon=True) for f in (self._live, self._rss)]

    def __enter__(self) -> Sampler:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stopped.set()
        for t in self.threads:
            t.join(PROBE_TIMEOUT_S + 1)

    def _live(self) -> None:
        conn: http.client.HTTPConnection | None = None
        due = time.monotonic()
        while not self.stopped.is_set():
            start = time.monotonic()
            try:
                if conn is None:
                    conn = http.client.HTTPConnection("127.0.0.1", self.port,
                                                      timeout=PROBE_TIMEOUT_S)
                conn.request("GET", "/liveness")
                resp = conn.getresponse()
                resp.read()
                ok = resp.status == 200
            except (OSError, http.client.HTTPException):
                ok = False
                if conn is not None:
                    conn.close()
                conn = None
            took = time.monotonic() - start
            ms = took * 1000 if ok else max(took, PROBE_TIMEOUT_S) * 1000  # a miss: the timeout
            self.live.append((round(start - self.t0, 3), round(ms, 2), ok))
            due = max(due + 0.05, time.monotonic())
            self.stopped.wait(max(0.0, due - time.monotonic()))

    def _rss(self) -> None:
        while not self.stopped.wait(0.1):
            kib = rss_kib(self.pid)
            self.rss.append((round(time.monotonic() - self.t0, 3), kib))
            if kib > self.guard_kib and self.killed_at is None:
                self.killed_at = time.monotonic() - self.t0
                os.kill(self.pid, signal.SIGKILL)

    def window(self, start: float, end: float) -> dict[str, Any]:
        """Liveness and RSS between two times (seconds since t0)."""
        live = [(ms, ok) for t, ms, ok in self.live if start <= t < end]
        lat = sorted(ms for ms, _ in live) or [0.0]
        rss = [k for t, k in self.rss if start <= t < end] or [0]
        return {"liveness_n": len(live), "liveness_failed": sum(not ok for _, ok in live),
                "liveness_p50_ms": round(statistics.median(lat), 2),
                "liveness_p99_ms": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 2),
                "liveness_max_ms": round(lat[-1], 2), "rss_max_mib": round(max(rss) / 1024, 1)}


class Phase:
    """What the traffic and control clients saw during one phase."""

    def __init__(self, name: str, attacks: list[str]) -> None:
        self.name, self.attacks = name, attacks
        self.counts: dict[str, int] = {}
        self.failures: list[str] = []
        self.leaks: list[str] = []
        self.control: dict[str, dict[str, Any]] = {}

    def add(self, key: str) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1


async def honest_request(session: aiohttp.ClientSession, base: str, i: int, ph: Phase) -> None:
    stream = i % 2 == 0
    body = {"text": f"honest request {i} " * (1 + i % 7), "stream": stream,
            "sampling_params": {"max_new_tokens": 4}}
    ph.add("sent")
    try:
        async with session.post(base + "/generate", json=body,
                                headers={"Authorization": f"Bearer {KEY}"},
                                timeout=aiohttp.ClientTimeout(total=35)) as resp:
            text = (await resp.read()).decode(errors="replace")
            if resp.status != 200 or (stream and not text.rstrip().endswith("[DONE]")):
                ph.failures.append(f"{resp.status} stream={stream}: {text[-160:]!r}")
            else:
                ph.add("answered_by_hostile" if HOSTILE_TEXT in text else "answered_by_honest")
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        ph.failures.append(f"{exc.__class__.__name__}: {exc}")


async def control_call(session: aiohttp.ClientSession, base: str, path: str, ph: Phase) -> None:
    """GET ``path`` with the user key (reading at most ``READ_CAP``); note any secret read."""
    stat = ph.control.setdefault(path, {"calls": 0, "statuses": {}, "max_s": 0.0, "mib": 0.0,
                                        "truncated": 0})
    stat["calls"] += 1
    start, data, status = time.monotonic(), b"", "error"
    try:
        async with session.get(base + path, headers={"Authorization": f"Bearer {USER_KEY}"},
                               timeout=aiohttp.ClientTimeout(total=15)) as resp:
            status = str(resp.status)
            parts, size = [], 0
            async for chunk in resp.content.iter_chunked(1 << 16):
                parts.append(chunk)
                size += len(chunk)
                if size >= READ_CAP:
                    stat["truncated"] += 1
                    break
            data = b"".join(parts)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        status = exc.__class__.__name__
    stat["statuses"][status] = stat["statuses"].get(status, 0) + 1
    stat["max_s"] = round(max(stat["max_s"], time.monotonic() - start), 2)
    stat["mib"] = round(stat["mib"] + len(data) / (1 << 20), 1)
    if MARKER.encode() in data:
        ph.leaks.append(f"{path}: a planted secret value")
    try:
        fields = secret_fields(json.loads(data)) if data and len(data) < READ_CAP else []
    except ValueError:
        fields = []
    ph.leaks += [f"{path}: field {f}" for f in fields]


async def drive(base: str, ph: Phase, secs: float, rate: float, control_clients: int) -> None:
    """Honest traffic at ``rate`` and ``control_clients`` control readers for ``secs``."""
    end = time.monotonic() + secs
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def reader(k: int) -> None:
            n = k
            while time.monotonic() < end:
                await control_call(session, base, CONTROL[n % len(CONTROL)], ph)
                n += 1

        readers = [asyncio.create_task(reader(k)) for k in range(control_clients)]
        tasks, i = [], 0
        while time.monotonic() < end:
            tasks.append(asyncio.create_task(honest_request(session, base, i, ph)))
            i += 1
            await asyncio.sleep(1.0 / rate)
        await asyncio.gather(*tasks, *readers)


def get_json(url: str, key: str | None = None, body: Any = None, timeout: float = 10) -> Any:
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except (OSError, ValueError) as exc:
        return {"error": f"{exc.__class__.__name__}: {exc}"}


def router_view(base: str, hostile: str) -> dict[str, Any]:
    """What the router says of the hostile worker's KV events and load feed."""
    state = get_json(base + "/list_workers", ADMIN_KEY)
    if "error" in state and len(state) == 1:
        return state
    kv = state.get("cache_truth", {}).get("workers", {}).get(hostile, {})
    feed = state.get("load_feed", {}).get("workers", {}).get(hostile, {})
    worker = next((w for w in state.get("workers", []) if w.get("url") == hostile), {})
    return {"cache_truth": kv.get("cache_truth"), "kv_sources": kv.get("sources"),
            "load_source": feed.get("load_source"), "feed_ranks": feed.get("ranks"),
            "healthy": worker.get("healthy"), "tables": state.get("tables")}


def attached(view: dict[str, Any]) -> bool:
    return view.get("cache_truth") == "kv-events" and view.get("load_source") == "feed"


def verdict(row: dict[str, Any]) -> list[str]:
    """Why a phase failed (empty: it passed)."""
    why = []
    if row["liveness_p99_ms"] >= LIVENESS_P99_MS or row["liveness_failed"]:
        why.append(f"/liveness p99 {row['liveness_p99_ms']} ms, {row['liveness_failed']} failed")
    if row["rss_max_mib"] >= RSS_LIMIT_MIB:
        why.append(f"RSS {row['rss_max_mib']} MiB")
    if row["honest_failed"]:
        why.append(f"{row['honest_failed']} requests failed")
    if row["secrets_read"]:
        why.append(f"{row['secrets_read']} secrets read")
    return why


def plot(sampler: Sampler, phases: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    top.plot([t for t, _, _ in sampler.live], [ms for _, ms, _ in sampler.live], ".",
             markersize=2, color="tab:blue")
    top.axhline(LIVENESS_P99_MS, color="tab:red", linestyle="--", linewidth=0.8)
    top.set_yscale("log")
    top.set_ylabel("/liveness latency (ms)")
    top.set_title("OmniProxy against a hostile worker: /liveness and RSS")
    bottom.plot([t for t, _ in sampler.rss], [k / 1024 for _, k in sampler.rss], color="tab:green")
    bottom.axhline(RSS_LIMIT_MIB, color="tab:red", linestyle="--", linewidth=0.8)
    bottom.set_ylabel("router RSS (MiB)")
    bottom.set_xlabel("seconds")
    for k, ph in enumerate(phases):
        for ax in (top, bottom):
            ax.axvspan(ph["start_s"], ph["end_s"], alpha=0.08 if k % 2 else 0.16,
                       color="tab:orange" if ph["name"] != "calm" else "tab:gray")
        top.text(ph["start_s"], top.get_ylim()[1], ph["name"], fontsize=6, rotation=90,
                 va="top")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def run(args: argparse.Namespace) -> int:
    """The whole benchmark; 0 if every phase passed."""
    attacks = [a for a in args.hostile_attacks.split(",") if a]
    unknown = set(attacks) - set(ATTACKS)
    if unknown:
        raise SystemExit(f"unknown attacks: {sorted(unknown)}")
    out = Path(args.out)
    log_dir = Path(tempfile.mkdtemp(prefix="omniproxy-hostile-"))
    hp, kv, replay, load = (free_port() for _ in range(4))
    honest_port = free_port()
    hostile_url, honest_url = f"http://127.0.0.1:{hp}", f"http://127.0.0.1:{honest_port}"
    kv_config = json.dumps({"publisher": "zmq", "endpoint": f"tcp://*:{free_port()}",
                            "replay_endpoint": f"tcp://*:{free_port()}"})
    procs = [spawn([sys.executable, str(HERE / "hostile_worker.py"), "--port", str(hp),
                    "--kv-port", str(kv), "--replay-port", str(replay), "--load-port",
                    str(load)], hp, log_dir / "hostile.log")]
    plan = [(a, [a]) for a in attacks if a != "secrets"] if args.hostile_each else []
    plan.append(("all", attacks))
    phases: list[dict[str, Any]] = []
    result: dict[str, Any] = {"attacks": {a: ATTACKS[a] for a in attacks},
                              "hostile_secs": args.hostile_secs, "rate": args.hostile_rate}
    try:
        procs.append(spawn([sys.executable, "-m", "omniinfer.emulator", "--profile",
                            "cpu-smollm2", "--port", str(honest_port), "--time-scale", "0.02",
                            "--kv-events-config", kv_config, "--load-publish-endpoint",
                            f"tcp://*:{free_port()}"], honest_port, log_dir / "honest.log"))
        router_args = ["--worker-urls", hostile_url, honest_url, "--cache-truth", "kv-events",
                       "--load-feed", "auto", "--api-key", KEY, "--control-plane-api-keys",
                       f"ops:ops:admin:{ADMIN_KEY}", f"u1:app:user:{USER_KEY}",
                       "--health-check-interval-secs", "1", "--request-timeout-secs", "30",
                       "--log-level", "warn"]
        result["router_args"] = router_args
        with RouterProcess(router_args, log_dir / "router.log") as router:
            assert router.process is not None
            base, t0 = router.base_url, time.monotonic()
            deadline = t0 + 30
            while not attached(view := router_view(base, hostile_url)) and \
                    time.monotonic() < deadline:
                time.sleep(0.5)
            result["attached"] = attached(view)
            result["view_at_attach"] = view
            with Sampler(router.port, router.process.pid, t0,
                         int(args.rss_guard_mib * 1024)) as sampler:
                for name, armed in [("calm", [])] + plan:
                    if sampler.killed_at is not None:
                        break
                    ph = Phase(name, armed)
                    before = get_json(hostile_url + "/hostile/stats").get("sent", {})
                    if armed:
                        get_json(hostile_url + "/hostile/arm", body={"attacks": armed})
                    start = time.monotonic() - t0
                    asyncio.run(drive(base, ph, args.calm_secs if name == "calm"
                                      else args.hostile_secs, args.hostile_rate, 2))
                    end = time.monotonic() - t0
                    get_json(hostile_url + "/hostile/disarm", body={})
                    time.sleep(2.0)  # endless answers end, queues drain: counted to the phase
                    settled = time.monotonic() - t0
                    after = get_json(hostile_url + "/hostile/stats").get("sent", {})
                    row = {"name": name, "attacks": armed, "start_s": round(start, 2),
                           "end_s": round(end, 2), **sampler.window(start, settled),
                           "honest_sent": ph.counts.get("sent", 0),
                           "answered_by_honest": ph.counts.get("answered_by_honest", 0),
                           "answered_by_hostile": ph.counts.get("answered_by_hostile", 0),
                           "honest_failed": len(ph.failures), "failure_examples": ph.failures[:5],
                           "secrets_read": len(ph.leaks), "secret_examples": ph.leaks[:8],
                           "control": ph.control,
                           "hostile_sent": {k: v - before.get(k, 0) for k, v in after.items()
                                            if v != before.get(k, 0)},
                           "router_view": router_view(base, hostile_url)}
                    row["failed_because"] = verdict(row)
                    phases.append(row)
            alive = get_json(base + "/liveness", timeout=5)
            result["alive_after"] = alive.get("status") == "alive"
            result["rss_killed_at_s"] = sampler.killed_at
            result["liveness_series"] = sampler.live
            result["rss_series_kib"] = sampler.rss
            router_log = (log_dir / "router.log").read_text(errors="replace")
            result["router_log"] = {"tracebacks": router_log.count("Traceback"),
                                    "subscriber_failed": router_log.count("subscriber failed"),
                                    "lines": router_log.count("\n")}
    finally:
        for p in procs:
            p.kill()
    result["phases"] = phases
    ok = bool(result["attached"]) and result["alive_after"] and \
        result["rss_killed_at_s"] is None and not any(p["failed_because"] for p in phases)
    result["pass"] = ok
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(sampler, phases, out.with_suffix(".png"))
    print(f"{'phase':<18} {'live p50':>8} {'p99':>8} {'max':>8} {'fail':>4} {'RSS MiB':>8} "
          f"{'reqs':>5} {'honest':>6} {'hostile':>7} {'failed':>6} {'secrets':>7}  verdict")
    for p in phases:
        print(f"{p['name']:<18} {p['liveness_p50_ms']:>8} {p['liveness_p99_ms']:>8} "
              f"{p['liveness_max_ms']:>8} {p['liveness_failed']:>4} {p['rss_max_mib']:>8} "
              f"{p['honest_sent']:>5} {p['answered_by_honest']:>6} "
              f"{p['answered_by_hostile']:>7} {p['honest_failed']:>6} {p['secrets_read']:>7}  "
              f"{'; '.join(p['failed_because']) or 'PASS'}")
    print(f"attached: {result['attached']}  alive after: {result['alive_after']}  "
          f"killed for RSS at: {result['rss_killed_at_s']}  router log: {result['router_log']}")
    print("results:", out, " plot:", out.with_suffix(".png"), " process logs:", log_dir)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1
