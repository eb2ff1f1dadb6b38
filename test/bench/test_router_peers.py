"""The Rust router beside OmniProxy in the router benchmarks (smg 1.13 by default, or
sglang-router 0.3.2): the command lines built for PD and regular clusters, as each router's own
argument parser reads them, the same load-polling rate for both routers beside smg, and the
target lists per peer. No process is started."""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmark" / "proxy"))
sys.path.insert(0, str(ROOT / "benchmark" / "router"))

import cluster  # noqa: E402
import oas_eval  # noqa: E402
import overhead  # noqa: E402
import prefix_eval  # noqa: E402

PREFILL = [("http://127.0.0.1:1001", 9001), ("http://127.0.0.1:1002", 9002)]
DECODE = ["http://127.0.0.1:2001", "http://127.0.0.1:2002"]
REGULAR = ["http://127.0.0.1:3001", "http://127.0.0.1:3002", "http://127.0.0.1:3003"]
SMG_POLICIES = ["round_robin", "power_of_two", "cache_aware", "least_load", "prefix_hash",
                "consistent_hashing", "bucket"]


def _pd(n_decode: int = 2) -> Any:
    return SimpleNamespace(prefill=PREFILL, decode=DECODE[:n_decode], regular=[])


def _regular() -> Any:
    return SimpleNamespace(prefill=[], decode=[], regular=REGULAR)


def _parsed(command: list[str]) -> Any:
    """The router's own reading of a command line (its launcher's parser; nothing started)."""
    module = command[command.index("-m") + 1]
    if module == "smg.launch_router":
        from smg.launch_router import parse_router_args
    else:
        assert module == "sglang_router.launch_router"
        from sglang_router.launch_router import parse_router_args
    return parse_router_args(command[command.index("-m") + 2:])


def _flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def _but_prometheus(command: list[str]) -> list[str]:
    at = command.index("--prometheus-port")
    return command[:at] + command[at + 2:]


def test_smg_pd_command_polls_every_poll_secs_and_decode_falls_back_to_round_robin() -> None:
    cmd = cluster.peer_router_command("smg", _pd(1), "power_of_two", 4321, poll_s=2)
    assert cmd[1:3] == ["-m", "smg.launch_router"]
    args = _parsed(cmd)
    assert args.pd_disaggregation and args.port == 4321 and args.host == "127.0.0.1"
    assert (args.prefill_policy, args.decode_policy) == ("power_of_two", "round_robin")
    assert args.load_monitor_interval == 2  # not smg's default 10
    assert args.prefill_urls == PREFILL and args.decode_urls == DECODE[:1]
    assert args.prometheus_port not in (None, 29000)  # a free port: two routers never clash
    two = _parsed(cluster.peer_router_command("smg", _pd(2), "power_of_two", 4321))
    assert two.decode_policy == "power_of_two" and two.load_monitor_interval == 1


def test_smg_bucket_is_a_prefill_policy_only() -> None:
    args = _parsed(cluster.peer_router_command("smg", _pd(2), "bucket", 4321))
    assert (args.prefill_policy, args.decode_policy) == ("bucket", "round_robin")


def test_smg_regular_command() -> None:
    cmd = cluster.peer_router_command("smg", _regular(), "prefix_hash", 4321, poll_s=3)
    assert "--pd-disaggregation" not in cmd and "--prefill" not in cmd
    args = _parsed(cmd)
    assert not args.pd_disaggregation
    assert args.policy == "prefix_hash" and args.worker_urls == REGULAR
    assert args.load_monitor_interval == 3


def test_sglang_router_commands_are_as_before() -> None:
    pd = cluster.peer_router_command("sglang-router", _pd(1), "power_of_two", 4321, poll_s=5)
    before = cluster.sglang_router_command(_pd(1), "power_of_two", "round_robin", 4321)
    assert _but_prometheus(pd) == _but_prometheus(before)  # the port is a free one each time
    assert "--load-monitor-interval" not in pd
    args = _parsed(pd)
    assert args.pd_disaggregation and args.prefill_urls == PREFILL
    assert (args.prefill_policy, args.decode_policy) == ("power_of_two", "round_robin")
    regular = _parsed(cluster.peer_router_command("sglang-router", _regular(), "cache_aware",
                                                  4321))
    assert regular.policy == "cache_aware" and regular.worker_urls == REGULAR
    with pytest.raises(ValueError, match="unknown peer"):
        cluster.peer_router_command("nginx", _pd(), "round_robin", 4321)


def test_omniproxy_polls_at_smgs_rate_and_as_before_beside_sglang_router() -> None:
    for peer, expected in (("smg", "2"), ("sglang-router", "0.5")):
        args = cluster.omni_router_args(_pd(), "oas", "oas",
                                        poll_s=cluster.omni_poll_s(peer, 2))
        assert _flag(args, "--loads-poll-interval-secs") == expected
    # what sglang-router runs keep: omni_router_args' own default
    default = inspect.signature(cluster.omni_router_args).parameters["poll_s"].default
    assert cluster.omni_poll_s("sglang-router", 7) == default


def test_a_targets_router_command_is_omniproxy_or_the_peer_its_prefix_names() -> None:
    cmd = cluster.target_router_command("omni", "oas", _pd(), 4321, peer="smg", poll_secs=2,
                                        cache_truth="kv-events", ttft_slo_secs=1.5,
                                        load_feed="off")
    assert cmd == cluster.omni_router_command(cluster.omni_router_args(
        _pd(), "oas", "oas", None, "kv-events", 1.5, poll_s=2.0, load_feed="off"), 4321)
    for router, peer, module in (("smg", "sglang-router", "smg.launch_router"),
                                 ("sglang", "smg", "sglang_router.launch_router")):
        cmd = cluster.target_router_command(router, "round_robin", _pd(), 4321, peer=peer,
                                            poll_secs=3)
        assert cmd[cmd.index("-m") + 1] == module  # the prefix wins over --peer


def test_omniproxy_reads_the_load_feed_unless_told_to_poll() -> None:
    assert _flag(cluster.omni_router_args(_pd(), "oas", "oas"), "--load-feed") == "auto"
    assert _flag(cluster.omni_router_args(_pd(), "oas", "oas", load_feed="off"),
                 "--load-feed") == "off"
    args = cluster.kv_events_args(load_feed=True)
    config = json.loads(args[args.index("--kv-events-config") + 1])
    feed = args[args.index("--load-publish-endpoint") + 1]
    assert feed.startswith("tcp://*:") and feed != config["endpoint"]
    assert "--load-publish-endpoint" not in cluster.kv_events_args()


def test_peer_flags() -> None:
    p = argparse.ArgumentParser()
    cluster.add_peer_args(p)
    assert vars(p.parse_args([])) == {"peer": "smg", "poll_secs": 1}
    assert p.parse_args(["--peer", "sglang-router", "--poll-secs", "3"]).poll_secs == 3
    for bad in (["--poll-secs", "0"], ["--poll-secs", "0.5"], ["--peer", "other"]):
        with pytest.raises(SystemExit):
            p.parse_args(bad)


def test_oas_eval_targets_per_peer() -> None:
    smg = [t for t in oas_eval.targets(False) if t.router != "omni"]
    assert [t.name for t in smg] == [f"smg:{p}" for p in SMG_POLICIES]
    assert all(t.router == "smg" and t.name == f"smg:{t.policy}" for t in smg)
    old = [t.name for t in oas_eval.targets(False, peer="sglang-router") if t.router != "omni"]
    assert old == ["sglang:round_robin", "sglang:cache_aware", "sglang:power_of_two"]
    ours = [t.name for t in oas_eval.targets(True, ("router", "kv-events"), "smg")
            if t.router == "omni"]
    assert "omni:oas@kv-events" in ours and "omni:oas_no_defer" in ours


def _prefix_args(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    monkeypatch.setattr(sys, "argv", ["prefix_eval.py", *argv])
    return prefix_eval.parse_args()


def test_prefix_eval_targets_per_peer_and_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    args = _prefix_args([], monkeypatch)
    assert (args.peer, args.poll_secs) == ("smg", 1)
    names = [t.name for t in args.targets]
    assert names == ["omni:oas", "omni:oas@kv-events", "omni:cache_aware",
                     *(f"smg:{p}" for p in SMG_POLICIES)]
    assert [t.name for t in prefix_eval.cluster_targets(args.targets, "4P1D")] == names
    assert [t.name for t in prefix_eval.cluster_targets(args.targets, "8R")] == [
        n for n in names if n != "smg:bucket"]  # smg has no bucket over regular workers
    old = _prefix_args(["--peer", "sglang-router"], monkeypatch)
    assert [t.name for t in old.targets][3:] == ["sglang:round_robin", "sglang:cache_aware",
                                                 "sglang:power_of_two"]
    assert prefix_eval.Target.parse("smg:bucket").router == "smg"
    with pytest.raises(SystemExit):  # a comparison polls at one peer's rate: no mixing
        _prefix_args(["--peer", "sglang-router", "--targets", "omni:oas,smg:cache_aware"],
                     monkeypatch)


def test_prefix_eval_router_command_per_peer() -> None:
    args = argparse.Namespace(slo_ttft=1.0, time_scale=8.0, peer="smg", poll_secs=2)
    omni = prefix_eval.router_command(prefix_eval.Target.parse("omni:oas"), _regular(), 4321, args)
    assert _flag(omni, "--loads-poll-interval-secs") == "2"
    smg = prefix_eval.router_command(prefix_eval.Target.parse("smg:least_load"), _regular(),
                                     4321, args)
    assert _flag(smg, "-m") == "smg.launch_router" and _flag(smg, "--load-monitor-interval") == "2"
    assert _flag(smg, "--policy") == "least_load"
    args.peer = "sglang-router"
    omni = prefix_eval.router_command(prefix_eval.Target.parse("omni:oas"), _regular(), 4321, args)
    assert _flag(omni, "--loads-poll-interval-secs") == "0.5"
    old = prefix_eval.router_command(prefix_eval.Target.parse("sglang:cache_aware"), _pd(1),
                                     4321, args)
    assert _flag(old, "-m") == "sglang_router.launch_router"
    assert _flag(old, "--decode-policy") == "round_robin"


def _overhead_args(peer: str, policy: str = "round_robin") -> argparse.Namespace:
    return argparse.Namespace(peer=peer, poll_secs=1, policy=policy, kv_events=False,
                              baseline_tree=None)


def test_overhead_commands_per_peer() -> None:
    urls = REGULAR[:2]
    for peer in ("smg", "sglang-router"):
        cmd = overhead.router_command(peer, urls, 4321, _overhead_args(peer), ["--api-key", "k"])
        args = _parsed(cmd)
        assert args.worker_urls == urls and args.policy == "round_robin" and args.port == 4321
        assert args.api_key == "k" and args.prometheus_port not in (None, 29000)
        assert ("--load-monitor-interval" in cmd) == (peer == "smg")
    assert _parsed(overhead.router_command("smg", urls, 1, _overhead_args("smg"), [])
                   ).load_monitor_interval == 1
    ours = overhead.router_command("omniproxy", urls, 4321, _overhead_args("smg"), [])
    assert _flag(ours, "-m") == "omniinfer.router"
    assert _flag(ours, "--loads-poll-interval-secs") == "1"  # smg's rate
    ours = overhead.router_command("omniproxy", urls, 4321, _overhead_args("sglang-router"), [])
    assert "--loads-poll-interval-secs" not in ours  # as before: OmniProxy's default


def test_overhead_peer_policy_falls_back_to_cache_aware() -> None:
    assert overhead.peer_policy("smg", "least_load") == "least_load"
    assert overhead.peer_policy("sglang-router", "least_load") == "cache_aware"
    assert overhead.peer_policy("smg", "oas") == "cache_aware"
    cmd = overhead.router_command("smg", REGULAR, 1, _overhead_args("smg", "oas"), [])
    assert _parsed(cmd).policy == "cache_aware"
