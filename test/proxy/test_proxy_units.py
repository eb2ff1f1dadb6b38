"""Pure tests of the router's parts: hashing, prefix index, lifecycle, breaker, admission,
policies, registry and flag parsing (no servers)."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
from pathlib import Path
from typing import Any

import pytest

from omniinfer.proxy.admission import Admission, Rejected
from omniinfer.proxy.circuit import BreakerState, CircuitBreaker
from omniinfer.proxy.cli import add_arguments, resolve
from omniinfer.proxy.config import RouterConfig, config_from_args, parse_prefill
from omniinfer.proxy.policy_api import (
    Decision,
    Policy,
    PolicyContext,
    RouteRequest,
    available_policies,
    create_policy,
    least_loaded,
    register_policy,
)
from omniinfer.proxy.prefix import PrefixIndex, block_hashes
from omniinfer.proxy.request import PHASE_NAMES, Lifecycle, Phase
from omniinfer.proxy.tokenization import (
    ApproxTokenizer,
    BadRequest,
    output_budget,
    prompt_tokens,
)
from omniinfer.proxy.workers import Role, Worker, WorkerLoads


def test_block_hashes_are_chained_and_full_blocks_only() -> None:
    a = block_hashes(list(range(40)), 16)
    assert len(a) == 2  # the 8-token tail is not a block
    b = block_hashes([99] + list(range(1, 40)), 16)
    assert a[0] != b[0] and a[1] != b[1]  # a change in block 0 changes every later hash
    c = block_hashes(list(range(32)) + [7] * 16, 16)
    assert c[:2] == a[:2] and len(c) == 3
    assert block_hashes(list(range(40)), 16) == a  # deterministic


def test_prefix_index_longest_match_per_worker_and_lru() -> None:
    index = PrefixIndex(max_blocks_per_worker=4)
    prompt = block_hashes(list(range(64)), 16)  # 4 blocks
    index.insert("w1", prompt)
    index.insert("w2", prompt[:2])
    assert index.match(prompt) == {"w1": 4, "w2": 2}
    other = block_hashes([5] * 64, 16)
    assert index.match(other) == {}
    index.insert("w1", other[:2])  # evicts w1's two oldest blocks (LRU, cap 4)
    assert index.size("w1") == 4
    assert "w1" not in index.match(prompt)  # its first block is gone: the chain is broken
    index.clear("w2")
    assert index.match(prompt) == {}


def test_lifecycle_phases_in_order_with_durations() -> None:
    life = Lifecycle("r", now=0.0)
    for i, phase in enumerate(Phase):
        if phase is not Phase.DECODE_RUNNING:
            assert life.enter(phase, now=float(i))
    assert not life.enter(Phase.PREFILL_RUNNING, now=100.0)  # earlier phase after later: ignored
    life.token(now=7.0)
    life.output_tokens = 11
    life.finish(now=12.0)
    d = life.durations()
    assert list(d) == list(PHASE_NAMES)
    assert d["tokenize"] == 1.0 and d["decode_running"] == 5.0
    assert life.ttft() == 7.0 and life.tpot() == pytest.approx(0.5)


def test_circuit_breaker_opens_half_opens_and_closes() -> None:
    b = CircuitBreaker(failure_threshold=2, success_threshold=2, open_secs=5.0)
    b.record_failure(0.0)
    assert b.allows(0.1)
    b.record_failure(1.0)
    assert b.state == BreakerState.OPEN and not b.allows(2.0)
    assert b.allows(6.5) and b.state == BreakerState.HALF_OPEN
    b.record_failure(6.6)  # a failed probe reopens
    assert not b.allows(7.0)
    assert b.allows(12.0)
    b.record_success()
    b.record_success()
    assert b.state == BreakerState.CLOSED


def test_admission_bounded_queue_fifo_and_timeout() -> None:
    async def scenario() -> None:
        adm = Admission(max_concurrent=1, queue_size=1, queue_timeout_s=0.2)
        await adm.acquire()
        waiter = asyncio.ensure_future(adm.acquire())
        await asyncio.sleep(0)
        with pytest.raises(Rejected) as full:
            await adm.acquire()
        assert full.value.reason == "queue_full" and full.value.retry_after >= 1
        adm.release()  # the slot goes to the waiter
        await waiter
        assert adm.active == 1 and adm.queued == 0
        with pytest.raises(Rejected) as late:
            await adm.acquire()
        assert late.value.reason == "queue_timeout"
        adm.release()
        assert adm.active == 0

    asyncio.run(scenario())


def _workers(*loads: int) -> list[Worker]:
    out = []
    for i, load in enumerate(loads):
        w = Worker(f"http://w{i}:1", Role.REGULAR, healthy=True)
        w.inflight_tokens = load
        out.append(w)
    return out


def _context(role: Role = Role.REGULAR) -> PolicyContext:
    return PolicyContext(RouterConfig(), PrefixIndex(), role, mean_request_tokens=100.0)


def _route(ctx: PolicyContext, tokens: list[int]) -> RouteRequest:
    hashes = block_hashes(tokens, 16)
    return RouteRequest("r", len(tokens), 16, hashes, 16,
                        matched_blocks=ctx.prefix_index.match(hashes))


def test_cache_aware_hit_miss_and_imbalance_gate() -> None:
    ctx = _context()
    policy = create_policy("cache_aware", ctx)
    w = _workers(0, 0, 0)
    prompt = list(range(160))
    ctx.prefix_index.insert(w[1].url, block_hashes(prompt, 16))
    ctx.prefix_index.insert(w[0].url, block_hashes([3] * 320, 16))  # w0's tree is the largest
    hit = policy.pick(_route(ctx, prompt), w)
    assert (hit.worker, hit.reason) == (w[1], "cache_hit")
    # 40% cached is under the 0.5 threshold: the smallest tree (w2, empty) gets it
    miss = policy.pick(_route(ctx, prompt[:64] + [7] * 96), w)
    assert (miss.worker, miss.reason) == (w[2], "cache_miss")
    # imbalance: 32 requests' worth (x100 tokens) and 1.1x → least loaded, despite the cache
    w[1].inflight_tokens, w[0].inflight_tokens, w[2].inflight_tokens = 5000, 1000, 1500
    gated = policy.pick(_route(ctx, prompt), w)
    assert (gated.worker, gated.reason) == (w[0], "imbalance")
    w[1].inflight_tokens = 3000  # a 2000-token gap is under 3200: cache wins again
    assert policy.pick(_route(ctx, prompt), w).worker is w[1]


def test_power_of_two_picks_the_lighter_of_two_in_tokens() -> None:
    random.seed(1)
    policy = create_policy("power_of_two", _context())
    w = _workers(900, 10)
    picks = {policy.pick(_route(policy.context, [1] * 20), w).worker.url for _ in range(20)}
    assert picks == {w[1].url}
    w[0].inflight_tokens, w[0].inflight_requests, w[1].inflight_requests = 10, 1, 3
    assert least_loaded(w) is w[0]  # equal tokens: fewer requests


def test_round_robin_and_random_cover_all() -> None:
    rr = create_policy("round_robin", _context())
    w = _workers(0, 0, 0)
    assert [rr.pick(_route(rr.context, [1]), w).worker for _ in range(6)] == w + w
    rnd = create_policy("random", _context())
    assert {rnd.pick(_route(rnd.context, [1]), w).worker.url for _ in range(60)} == \
        {x.url for x in w}


def test_registry_takes_a_new_policy_in_one_class() -> None:
    @register_policy("test_first_worker")
    class FirstWorker(Policy):
        def pick(self, request: RouteRequest, workers: list[Worker]) -> Decision:
            return Decision(workers[0], "first")

    assert {"random", "round_robin", "power_of_two", "cache_aware",
            "test_first_worker"} <= set(available_policies())
    policy = create_policy("test_first_worker", _context())
    decision = asyncio.run(policy.schedule(_route(policy.context, [1]), _workers(5, 1)))
    assert decision is not None and decision.reason == "first"
    with pytest.raises(ValueError, match="unknown policy"):
        create_policy("nope", _context())


def test_prefill_flag_pairs_like_sglang_router() -> None:
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--pd-disaggregation", "--prefill", "http://p1:8000", "9000",
                         "--prefill", "http://p2:8000", "none", "--prefill", "http://p3:8000",
                         "--decode", "http://d1:8001", "--decode", "http://d2:8001",
                         "--prefill-policy", "cache_aware", "--decode-policy", "power_of_two"])
    config = config_from_args(args)
    assert config.prefill_urls == [("http://p1:8000", 9000), ("http://p2:8000", None),
                                   ("http://p3:8000", None)]
    assert config.decode_urls == ["http://d1:8001", "http://d2:8001"]
    assert config.policy_for("prefill") == "cache_aware"
    assert config.policy_for("decode") == "power_of_two"
    with pytest.raises(ValueError, match="bootstrap port"):
        parse_prefill([["http://p:1", "x"]])
    with pytest.raises(ValueError, match="--pd-disaggregation"):
        config_from_args(p.parse_args(["--decode", "http://d:1"]))
    pd = ["--pd-disaggregation", "--prefill", "http://p:1", "--decode", "http://d:1"]
    assert config_from_args(p.parse_args([*pd, "--oas-ttft-slo-secs", "2"])).oas_ttft_slo_secs == 2
    with pytest.raises(ValueError, match="--oas-ttft-slo-secs must be positive"):
        config_from_args(p.parse_args([*pd, "--oas-ttft-slo-secs", "0"]))


def _resolve(tmp_path: Path, file: dict[str, Any], *flags: str) -> RouterConfig:
    path = tmp_path / "router.json"
    path.write_text(json.dumps(file))
    p = argparse.ArgumentParser()
    add_arguments(p)
    return resolve(p.parse_args(["--config", str(path), *flags]))


def test_config_file_fills_flags_not_given_and_never_overrides_one_given(tmp_path: Path
                                                                         ) -> None:
    pd = {"pd_disaggregation": True, "prefill": [["http://p1:1", 9000], "http://p2:2"],
          "decode": ["http://d:1"]}
    config = _resolve(tmp_path, {**pd, "policy": "round_robin", "port": 31000,
                                 "disable-retries": True, "kv_events_max_pages": 64})
    assert (config.policy, config.port, config.disable_retries) == ("round_robin", 31000, True)
    assert config.prefill_urls == [("http://p1:1", 9000), ("http://p2:2", None)]
    assert config.decode_urls == ["http://d:1"] and config.kv_events_max_pages == 64
    # given at its default value, a flag still wins; a repeated flag replaces the file's list
    config = _resolve(tmp_path, {**pd, "policy": "round_robin", "cache_threshold": 0.9},
                      "--policy", "cache_aware", "--cache-threshold", "0.5",
                      "--prefill", "http://p3:3")
    assert (config.policy, config.cache_threshold) == ("cache_aware", 0.5)
    assert config.prefill_urls == [("http://p3:3", None)]
    assert _resolve(tmp_path, {"worker_urls": ["http://w:1"], "disable_retries": False},
                    ).disable_retries is False


@pytest.mark.parametrize("file, message", [
    ({"polcy": "oas"}, "unknown key 'polcy'"),
    ({"prefill_urls": [["http://p:1"]]}, "unknown key 'prefill_urls'"),  # a field, not a flag
    ({"pol": "oas"}, "unknown key 'pol'"),  # no abbreviations
    ({"port": "x"}, "port: argument --port: invalid int value"),
    ({"port": True}, "port: argument --port: expected one argument"),
    ({"cache_truth": "guess"}, "cache_truth: argument --cache-truth: invalid choice"),
    ({"decode": "http://d:1"}, "decode: expected a list"),
    ({"api_key": None}, "api_key: expected a string"),
    ({"config": "other.json"}, "cannot name another"),
])
def test_config_file_errors_name_the_key(tmp_path: Path, file: dict[str, Any],
                                         message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        _resolve(tmp_path, {"worker_urls": ["http://w:1"], **file})


def test_router_command_line_reports_a_bad_config_file_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from omniinfer.proxy import server
    from omniinfer.proxy.cli import main

    monkeypatch.setattr(server, "serve", lambda config: 0)  # a config that passes starts nothing
    path = tmp_path / "router.json"
    path.write_text('{"worker_urls": ["http://w:1"], "polcy": "oas"}')
    assert main(["--config", str(path)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"omniinfer router: error: --config {path}: unknown key 'polcy' (keys are flag names)"]
    assert main(["--config", str(tmp_path / "missing.json")]) == 2
    assert "No such file" in capsys.readouterr().err


def test_tokenization_shapes_and_errors() -> None:
    tok = ApproxTokenizer()
    assert prompt_tokens("generate", {"input_ids": [1, 2, 3]}, tok) == [[1, 2, 3]]
    assert len(prompt_tokens("generate", {"text": ["ab", "cd"]}, tok)) == 2
    assert prompt_tokens("chat", {"messages": [{"role": "user", "content": "hi"}]}, tok)[0]
    for endpoint, body in [("generate", {}), ("generate", {"text": 5}),
                           ("generate", {"input_ids": [1, "a"]}), ("chat", {"messages": "x"}),
                           ("completions", {"prompt": {"a": 1}})]:
        with pytest.raises(BadRequest):
            prompt_tokens(endpoint, body, tok)
    assert output_budget("generate", {"sampling_params": {"max_new_tokens": 7}}) == 7
    assert output_budget("chat", {"max_tokens": "x"}, default=9) == 9


def test_worker_loads_sum_ranks() -> None:
    loads = WorkerLoads.from_json({"loads": [
        {"num_running_reqs": 2, "num_waiting_reqs": 1, "token_usage": 0.2},
        {"num_running_reqs": 3, "num_waiting_reqs": 0, "token_usage": 0.5}]}, 1.0)
    assert (loads.running_reqs, loads.waiting_reqs, loads.token_usage) == (5, 1, 0.5)
    assert WorkerLoads.from_json("garbage", 1.0).running_reqs == 0
