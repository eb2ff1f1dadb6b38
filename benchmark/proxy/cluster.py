"""Emulated PD clusters and routers as child processes (each in its own process group).

``EmulatedCluster(n_prefill, n_decode, profile, time_scale)`` starts ``omniinfer
emulate-worker`` processes (``EmulatorProcess``); ``target_router_command`` builds the command
line of OmniProxy or of the peer for a target; ``start_router`` runs one as a ``ManagedProcess``
that is ready once a request went through it. The Rust router a benchmark
compares against (its peer) is ``smg`` 1.13 by default or ``sglang-router`` 0.3.2 (``PEERS``):
``peer_router_command`` builds either, ``peer_targets`` names its policies (``smg:POLICY``,
``sglang:POLICY``) and ``omni_poll_s`` gives OmniProxy smg's load-polling rate.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from omniinfer.child_process import ManagedProcess, free_port
from omniinfer.emulator.process import EmulatorProcess

__all__ = ["PEERS", "EmulatedCluster", "add_peer_args", "free_port", "omni_poll_s",
           "omni_router_args", "omni_router_command", "peer_decode_policy", "peer_of",
           "peer_router_command", "peer_targets", "sglang_router_command", "smg_router_command",
           "start_router", "target_router_command"]


def kv_events_args(load_feed: bool = False) -> list[str]:
    """``--kv-events-config`` of one emulator: SGLang's ZMQ publisher on a free port; with
    ``load_feed`` also SGLang's load feed (``--load-publish-endpoint``) on another one."""
    args = ["--kv-events-config",
            json.dumps({"publisher": "zmq", "endpoint": f"tcp://*:{free_port()}"})]
    if load_feed:
        args += ["--load-publish-endpoint", f"tcp://*:{free_port()}"]
    return args


class EmulatedCluster:
    """``n_prefill`` prefill and ``n_decode`` decode emulators of one profile, or ``n_regular``
    regular (non-PD) ones (``profile``: one name, or one per mode ``{"prefill": ...,
    "decode": ...}``; each publishing its KV events if ``kv_events``, for a router with
    ``--cache-truth kv-events``; and their load feed too if ``load_feed``, for a router with
    ``--load-feed auto``); ``cache_extra`` goes to the workers with a prefix cache only
    (prefill and regular), e.g. a smaller ``--max-total-tokens``, and ``decode_extra`` to the
    decode workers only."""

    def __init__(self, n_prefill: int, n_decode: int, profile: str | dict[str, str],
                 time_scale: float,
                 log_dir: Path, extra: tuple[str, ...] = (), kv_events: bool = False,
                 n_regular: int = 0, cache_extra: tuple[str, ...] = (),
                 decode_extra: tuple[str, ...] = (), load_feed: bool = False,
                 prefill_profiles: tuple[str, ...] = ()) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)

        def events() -> list[str]:
            return kv_events_args(load_feed) if kv_events or load_feed else []

        keep = ["--request-log-size", "0"]  # the request log is for tests: no memory for it here
        profiles = profile if isinstance(profile, dict) else {}  # per mode, or one for all

        def profile_of(mode: str, i: int) -> str:
            if mode == "prefill" and i < len(prefill_profiles):
                return prefill_profiles[i]
            return profiles.get(mode, profile)  # type: ignore[arg-type]

        self.procs = [EmulatorProcess(mode, profile_of(mode, i), time_scale, extra_args=[
                          *keep, *extra, *(cache_extra if mode != "decode" else decode_extra),
                          *events()],
                                      log_path=log_dir / f"{mode}{i}.log")
                      for mode, count in (("prefill", n_prefill), ("decode", n_decode),
                                          ("null", n_regular))
                      for i in range(count)]
        self.prefill: list[tuple[str, int]] = [(w.url, int(w.bootstrap_port or 0)) for w in self.procs
                                               if w.mode == "prefill"]  # (url, bootstrap port)
        self.decode: list[str] = [w.url for w in self.procs if w.mode == "decode"]
        self.regular: list[str] = [w.url for w in self.procs if w.mode == "null"]
        try:
            for proc in self.procs:  # all at once, then wait for each
                proc.launch()
            for proc in self.procs:
                proc.wait_ready()
        except BaseException:
            self.stop()
            raise

    def urls(self) -> list[str]:
        return [u for u, _ in self.prefill] + self.decode + self.regular

    def prefill_busy_s(self) -> list[float]:
        """Each prefill (or regular) worker's cumulative prefill time (wall s, /v1/loads)."""
        out = []
        for url in [u for u, _ in self.prefill] + self.regular:
            with urllib.request.urlopen(url + "/v1/loads", timeout=5) as r:
                out.append(sum(load["total_prefill_busy_us"] for load in json.load(r)["loads"]) / 1e6)
        return out

    def flush(self, timeout_s: float = 60.0) -> None:
        """Empty every worker's prefix cache (waits until each is idle)."""
        for url in self.urls():
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    req = urllib.request.Request(url + "/flush_cache", data=b"", method="POST")
                    with urllib.request.urlopen(req, timeout=5) as r:
                        if r.status == 200:
                            break
                except (urllib.error.URLError, OSError):
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{url} did not become idle")
                time.sleep(0.3)

    def stop(self) -> None:
        for proc in self.procs:
            proc.stop()


def _roles(cluster: EmulatedCluster, prefill_policy: str, decode_policy: str) -> list[str]:
    """PD: both roles' policies; regular workers: one policy over them (the prefill one)."""
    if cluster.regular:
        return ["--policy", prefill_policy, "--worker-urls", *cluster.regular]
    return ["--pd-disaggregation", "--prefill-policy", prefill_policy,
            "--decode-policy", decode_policy]


def omni_router_args(cluster: EmulatedCluster, prefill_policy: str, decode_policy: str,
                     access_log: Path | None = None, cache_truth: str = "router",
                     ttft_slo_secs: float | None = None, poll_s: float = 0.5,
                     load_feed: str = "auto") -> list[str]:
    roles = _roles(cluster, prefill_policy, decode_policy)
    args = [*roles, "--cache-truth", cache_truth, "--load-feed", load_feed, "--log-level", "warn",
            "--loads-poll-interval-secs", f"{poll_s:g}", "--max-concurrent-requests", "4096"]
    for url, boot in cluster.prefill:
        args += ["--prefill", url, str(boot)]
    for url in cluster.decode:
        args += ["--decode", url]
    if access_log is not None:
        args += ["--access-log", str(access_log)]
    if ttft_slo_secs is not None:
        args += ["--oas-ttft-slo-secs", f"{ttft_slo_secs:g}"]
    return args


def sglang_router_command(cluster: EmulatedCluster, prefill_policy: str, decode_policy: str,
                          port: int) -> list[str]:
    roles = _roles(cluster, prefill_policy, decode_policy)
    cmd = [sys.executable, "-m", "sglang_router.launch_router", *roles,
           "--host", "127.0.0.1", "--port", str(port), "--log-level", "warn",
           "--prometheus-port", str(free_port())]  # its default 29000 clashes between routers
    for url, boot in cluster.prefill:
        cmd += ["--prefill", url, str(boot)]
    for url in cluster.decode:
        cmd += ["--decode", url]
    return cmd


def smg_router_command(cluster: EmulatedCluster, prefill_policy: str, decode_policy: str,
                       port: int, load_interval_s: int = 1) -> list[str]:
    """smg 1.13 (``smg.launch_router``, the successor of sglang-router) as its docs show PD
    mode, polling worker loads every ``load_interval_s`` seconds (its default 10 is longer than
    a benchmark run; 1 is its smallest: give OmniProxy the same rate when comparing)."""
    roles = _roles(cluster, prefill_policy, decode_policy)
    cmd = [sys.executable, "-m", "smg.launch_router", *roles, "--host", "127.0.0.1",
           "--port", str(port), "--log-level", "warn", "--prometheus-port", str(free_port()),
           "--load-monitor-interval", str(load_interval_s)]
    if prefill_policy in VETO_BLIND:
        cmd += ["--disable-worker-overload-protection"]
    for url, boot in cluster.prefill:
        cmd += ["--prefill", url, str(boot)]
    for url in cluster.decode:
        cmd += ["--decode", url]
    return cmd


# smg 1.13 leaves a worker with more than 8 waiting requests out of routing (its overload veto,
# on by default), but bucket picks its worker among all prefill workers and then fails the
# request with a 503 when the pick is vetoed ("Policy bucket failed to select a prefill
# worker"): bucket runs with the veto off, its best configuration.
VETO_BLIND = ("bucket",)

PEERS = ("smg", "sglang-router")  # the Rust router beside OmniProxy; the first is the default
PEER_PREFIX = {"smg": "smg", "sglang-router": "sglang"}  # target names: smg:POLICY, sglang:POLICY
# the policies that apply to a benchmark (not random, manual, passthrough); bucket: PD prefill only
PEER_POLICIES = {"smg": ("round_robin", "power_of_two", "cache_aware", "least_load", "prefix_hash",
                         "consistent_hashing", "bucket"),
                 "sglang-router": ("round_robin", "cache_aware", "power_of_two")}
PREFILL_ONLY = ("bucket",)
OMNI_POLL_S = 0.5  # OmniProxy's load poll beside sglang-router 0.3.2 (as before smg)


def peer_of(prefix: str) -> str | None:
    """The peer of a target name's router part (``smg`` -> smg, ``sglang`` -> sglang-router)."""
    return next((peer for peer, p in PEER_PREFIX.items() if p == prefix), None)


def peer_targets(peer: str, pd: bool) -> list[str]:
    """The peer's target names for a PD (``pd``) or a regular cluster, in run order."""
    return [f"{PEER_PREFIX[peer]}:{p}" for p in PEER_POLICIES[peer]
            if pd or p not in PREFILL_ONLY]


def peer_decode_policy(cluster: EmulatedCluster, policy: str) -> str:
    """A PD pair's decode policy: the prefill one, or round_robin over one decode worker
    (sglang-router refuses power_of_two there; one choice is no choice) and for a prefill-only
    policy (bucket)."""
    return policy if len(cluster.decode) > 1 and policy not in PREFILL_ONLY else "round_robin"


def peer_router_command(peer: str, cluster: EmulatedCluster, policy: str, port: int,
                        poll_s: int = 1) -> list[str]:
    """The peer routing with ``policy`` (smg polling loads every ``poll_s`` seconds)."""
    decode = peer_decode_policy(cluster, policy)
    if peer == "smg":
        return smg_router_command(cluster, policy, decode, port, load_interval_s=poll_s)
    if peer == "sglang-router":
        return sglang_router_command(cluster, policy, decode, port)
    raise ValueError(f"unknown peer {peer!r}: one of {', '.join(PEERS)}")


def omni_poll_s(peer: str, poll_s: int) -> float:
    """OmniProxy's ``--loads-poll-interval-secs`` beside ``peer``: smg's own rate (the same
    for both routers), or the former 0.5 s beside sglang-router 0.3.2."""
    return float(poll_s) if peer == "smg" else OMNI_POLL_S


def _poll_secs(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("smg's --load-monitor-interval is whole seconds, >= 1")
    return value


def add_peer_args(parser: argparse.ArgumentParser) -> None:
    """``--peer`` (the Rust router compared against) and ``--poll-secs`` (its load polling)."""
    parser.add_argument("--peer", choices=PEERS, default=PEERS[0],
                        help="the Rust router beside OmniProxy: smg 1.13 (targets smg:POLICY) "
                        "or sglang-router 0.3.2 (targets sglang:POLICY)")
    parser.add_argument("--poll-secs", type=_poll_secs, default=1,
                        help="with smg: its --load-monitor-interval and OmniProxy's "
                        "--loads-poll-interval-secs, the same for both (whole seconds; smg's "
                        "default 10 is longer than a run); sglang-router: OmniProxy polls "
                        f"every {OMNI_POLL_S:g} s as before")


def omni_router_command(args: list[str], port: int) -> list[str]:
    return [sys.executable, "-m", "omniinfer.router", "--host", "127.0.0.1", "--port",
            str(port), *args]


def target_router_command(router: str, policy: str, cluster: EmulatedCluster, port: int, *,
                          peer: str, poll_secs: int, access_log: Path | None = None,
                          cache_truth: str = "router", ttft_slo_secs: float | None = None,
                          load_feed: str = "auto") -> list[str]:
    """The command line of a target's router on ``port``, ``policy`` for both PD roles.

    ``router`` "omni": OmniProxy (``omni_router_args``), polling loads every
    ``omni_poll_s(peer, poll_secs)`` seconds; any other: the peer its prefix names (``peer``
    when it names none), polling every ``poll_secs`` seconds. ``peer`` and ``poll_secs`` are
    ``add_peer_args``' ``--peer`` and ``--poll-secs``."""
    if router == "omni":
        return omni_router_command(omni_router_args(
            cluster, policy, policy, access_log, cache_truth, ttft_slo_secs,
            poll_s=omni_poll_s(peer, poll_secs), load_feed=load_feed), port)
    return peer_router_command(peer_of(router) or peer, cluster, policy, port, poll_secs)


def start_router(command: list[str], port: int, log: Path) -> ManagedProcess:
    """Start a router and wait until one tiny request goes through it."""
    router = ManagedProcess(command, {**os.environ, "HF_HUB_OFFLINE": "1"}, log, port,
                            ready_timeout_s=90.0, kind="router", ready_path="/generate", poll_s=0.2,
                            ready_body={"input_ids": [11, 12, 13], "sampling_params": {"max_new_tokens": 1}})
    router.start()
    return router
