"""Hardening, unit by unit: worker URL checks, who may call what, router-owned rids, bookings
given back, bounded tokenizing, access-log rotation, metric series of removed workers, and how
far a worker's KV-event publisher is trusted. Each test fails on the router before #17."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
from aiohttp.test_utils import make_mocked_request

from omniinfer.kv_event_wire import Batch, Stored
from omniinfer.proxy.auth import AccessControl, parse_control_plane_keys
from omniinfer.proxy.cache_truth import (
    NoEvents,
    Source,
    WorkerSubscription,
    sources_from_server_info,
)
from omniinfer.proxy.config import RouterConfig
from omniinfer.proxy.core import Router
from omniinfer.proxy.metrics import AccessLog, ProxyMetrics
from omniinfer.proxy.policy_api import PolicyContext, RouteRequest, create_policy
from omniinfer.proxy.prefix import ROOT_HASH, PrefixIndex, chain_hash
from omniinfer.proxy.tokenization import Tokenizer
from omniinfer.proxy.worker_cache_truth import WorkerCacheTruth
from omniinfer.proxy.workers import Role, Worker, WorkerPool, normalize_url


@pytest.mark.parametrize("url", [
    "http://h:1/v1/models", "http://h:1?x=1", "http://h:1#f", "http://user:pw@h:1",
    "ftp://h:1", "http://h:70000", "http://:80", "http://h:1/../admin", "http://h :1"])
def test_worker_urls_name_a_server_and_nothing_else(url: str) -> None:
    with pytest.raises(ValueError):
        normalize_url(url)
    assert normalize_url("10.0.0.1:30000/") == "http://10.0.0.1:30000"


def _request(path: str, method: str = "POST", remote: str = "127.0.0.1",
             key: str | None = None) -> Any:
    transport = mock.Mock()
    transport.get_extra_info.side_effect = lambda name, default=None: (
        (remote, 40000) if name == "peername" else default)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return make_mocked_request(method, path, headers=headers, transport=transport)


def test_admin_routes_answer_loopback_only_without_an_admin_key() -> None:
    access = AccessControl(None, [])
    for path in ("/add_worker", "/remove_worker", "/flush_cache"):
        assert access.check(_request(path, remote="10.1.2.3"))[0].status == 403
        assert access.check(_request(path, remote="127.0.0.1"))[0] is None
        assert access.check(_request(path, remote="::1"))[0] is None
    assert access.check(_request("/generate", remote="10.1.2.3"))[0] is None  # no key: open


def test_api_key_and_control_plane_roles() -> None:
    access = AccessControl("sk-data", ["a1:ops:admin:sk-admin", "u1:app:user:sk-user"],
                           audit=True)
    denied, _ = access.check(_request("/generate"))
    assert denied is not None and denied.status == 401
    for key in ("sk-data", "sk-user", "sk-admin"):  # every key may use the data plane
        assert access.check(_request("/generate", key=key))[0] is None
    assert access.check(_request("/generate", key="sk-wrong"))[0].status == 401
    assert access.check(_request("/health"))[0] is None  # health stays open
    assert access.check(_request("/metrics", "GET"))[0].status == 401  # it names the workers
    assert access.check(_request("/metrics", "GET", key="sk-user"))[0] is None
    assert access.check(_request("/add_worker", key="sk-user"))[0].status == 403
    assert access.check(_request("/add_worker", key="sk-data"))[0].status == 403
    assert access.check(_request("/add_worker"))[0].status == 401
    allowed, who = access.check(_request("/add_worker", remote="10.1.2.3", key="sk-admin"))
    assert allowed is None and who is not None and (who.key_id, who.role) == ("a1", "admin")
    with pytest.raises(ValueError):
        parse_control_plane_keys(["a1:ops:root:k"])
    with pytest.raises(ValueError):
        parse_control_plane_keys(["a1:ops:admin"])
    assert "sk-admin" not in repr(parse_control_plane_keys(["a1:ops:admin:sk-admin"]))


def test_router_rids_never_prefix_one_another() -> None:
    router = Router(RouterConfig(worker_urls=["http://127.0.0.1:9"]))
    rids = [*router.new_rids(1), *router.new_rids(12), *router.new_rids(1)]
    rids += [r for _ in range(200) for r in router.new_rids(1)]
    assert len(set(rids)) == len(rids)
    for a in rids:
        for b in rids:
            assert a == b or not b.startswith(a), (a, b)
    other = Router(RouterConfig(worker_urls=["http://127.0.0.1:9"]))
    assert other.new_rids(1)[0][:12] != rids[0][:12]  # another router process, another prefix


def _oas(role: Role, **config: Any) -> Any:
    return create_policy("oas", PolicyContext(RouterConfig(**config), PrefixIndex(), role))


def test_pd_prefill_booking_given_back_when_no_decode_decision_comes() -> None:
    """The client leaves while the decode decision waits (decode cap full): the prefill
    instance must not keep the booking (before, it never looked idle again)."""
    from omniinfer.proxy.attempt import decide
    from omniinfer.proxy.pd import PD
    from omniinfer.proxy.request import Request

    async def run() -> dict[str, int]:
        prefill, decode = _oas(Role.PREFILL), _oas(Role.DECODE, oas_decode_max_running=1)
        p, d = Worker("http://127.0.0.1:1", Role.PREFILL), Worker("http://127.0.0.1:2",
                                                                 Role.DECODE)
        p.healthy = d.healthy = True
        d.inflight_requests = 1  # at its cap: the decode decision waits
        router = SimpleNamespace(policies={Role.PREFILL: prefill, Role.DECODE: decode},
                                 indexes={Role.DECODE: PrefixIndex()})
        req = Request("r1", "generate")
        req.prepare({}, 1, RouteRequest("r1", 64, 8, (), 16))
        strategy = PD(router, None, req)  # type: ignore[arg-type]
        task = asyncio.ensure_future(decide(router, strategy,  # type: ignore[arg-type]
                                            {Role.PREFILL: [p], Role.DECODE: [d]}))
        for _ in range(50):  # until the prefill side has booked the request
            await asyncio.sleep(0)
            if prefill.clock(p).sent:
                break
        assert "r1" in prefill.clock(p).sent
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return dict(prefill.clock(p).sent)

    assert asyncio.run(run()) == {}


class _SlowTokenizer(Tokenizer):
    name = "slow"

    def __init__(self) -> None:
        self.running = 0
        self.peak = 0
        self.calls = 0
        self.release = threading.Event()
        self.lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        with self.lock:
            self.running += 1
            self.calls += 1
            self.peak = max(self.peak, self.running)
        self.release.wait(10)
        with self.lock:
            self.running -= 1
        return [1] * len(text)

    def encode_chat(self, messages: list[Any], body: dict[str, Any]) -> list[int]:
        return self.encode("chat")


def test_tokenizing_is_bounded_and_a_waiting_client_costs_nothing() -> None:
    async def run() -> _SlowTokenizer:
        router = Router(RouterConfig(worker_urls=["http://127.0.0.1:9"], tokenize_concurrency=1))
        router._loop_ref = asyncio.get_running_loop()
        tok = router.tokenizer = _SlowTokenizer()
        first = asyncio.ensure_future(router.tokenize("generate", b'{"text": "aaaa"}'))
        second = asyncio.ensure_future(router.tokenize("generate", b'{"text": "bbbb"}'))
        deadline = asyncio.get_running_loop().time() + 10
        while tok.calls < 1:  # the first prompt reached the tokenizer thread
            assert asyncio.get_running_loop().time() < deadline, "the tokenizer never ran"
            await asyncio.sleep(0.001)
        second.cancel()  # this client leaves while waiting for the slot
        tok.release.set()
        assert (await first)[1] == [[1, 1, 1, 1]]
        third = await router.tokenize("generate", b'{"text": "cc"}')
        assert third[1] == [[1, 1]]
        router._tokenize_pool.shutdown(wait=True)
        return tok

    tok = asyncio.run(run())
    assert tok.peak == 1 and tok.calls == 2  # the cancelled one never ran


def test_access_log_rotates(tmp_path: Path) -> None:
    path = tmp_path / "access.jsonl"
    log = AccessLog(str(path), max_bytes=1000, backups=2)
    for i in range(100):
        log.write({"i": i, "pad": "x" * 40})
    log.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["access.jsonl", "access.jsonl.1", "access.jsonl.2"]
    assert all(p.stat().st_size < 1100 for p in tmp_path.iterdir())
    assert '"i":99' in path.read_text()


def test_removed_workers_leave_no_metric_series() -> None:
    pool = WorkerPool()
    metrics = ProxyMetrics(pool)
    gone, kept = Worker("http://10.0.0.1:1", Role.REGULAR), Worker("http://10.0.0.2:1",
                                                                    Role.REGULAR)
    for w in (gone, kept):
        metrics.upstream_error(w.url, "regular", "connect")
    metrics.forget_worker(gone)
    text = metrics.render().decode()
    assert "10.0.0.2:1" in text and "10.0.0.1:1" not in text


# ---- KV-event trust -----------------------------------------------------------------------
def _info(**block: Any) -> dict[str, Any]:
    return {"kv_events": {"endpoint_host": "*", "endpoint_port_base": 5557, **block}}


def test_server_info_cannot_point_the_router_anywhere() -> None:
    assert len(sources_from_server_info(_info(dp_size=2), "10.0.0.7")[0]) == 2
    bad = [_info(endpoint_port_base=65535, dp_size=2),  # rank 1 on port 65536
           _info(endpoint_port_base=70000),  # crashed the router at start-up before
           _info(dp_size=100_000),  # would open 100,000 sockets
           _info(dp_size=0), _info(dp_size=True),
           _info(endpoint_host="169.254.169.254"),  # another host than the worker's
           _info(replay_endpoint_port_base=99999),
           {"kv_events_config": '{"publisher": "zmq", "endpoint": "tcp://evil:5557"}'},
           {"kv_events_config": '{"publisher": "zmq", "endpoint": "tcp://*:5557"}',
            "dp_size": 10_000}]
    for info in bad:
        with pytest.raises(NoEvents):
            sources_from_server_info(info, "10.0.0.7", max_ranks=64)
    assert sources_from_server_info(_info(endpoint_host="127.0.0.1"), "localhost")[0]


def test_a_bad_server_info_never_takes_the_router_down() -> None:
    from omniinfer.proxy.cache_truth import CacheTruth

    async def fetch(worker: Worker, path: str, timeout: float) -> Any:
        return {"kv_events": {"endpoint_port_base": "x" * 10, "dp_size": [1]},
                "kv_events_config": {"not": "a string"}}

    async def run() -> dict[str, Any]:
        truth = CacheTruth("kv-events", 16, {r: PrefixIndex() for r in Role}, fetch)
        worker = Worker("http://127.0.0.1:1", Role.REGULAR)
        await truth.attach(worker)
        await truth.close()
        return truth.describe()

    described = asyncio.run(run())
    assert described["workers"]["http://127.0.0.1:1"]["cache_truth"] == "router"


def test_page_memory_per_publisher_is_bounded() -> None:
    index = PrefixIndex()
    truth = WorkerCacheTruth("w", index, 2, sources=1, max_pages=10)
    parent = None
    for i in range(1, 12):
        truth.apply(0, Batch(0.0, (Stored((i,), parent, (i, i), 2),), 0, 0))
        parent = i
    assert truth.overflows == 1 and sum(len(c) for c in truth.chains) == 0
    assert truth.blocks() == 0 and index.match([chain_hash(ROOT_HASH, (1, 1))]) == {}


def test_a_malformed_batch_resets_that_publishers_view() -> None:
    index = PrefixIndex()
    truth = WorkerCacheTruth("w", index, 2)
    truth.apply(0, Batch(0.0, (Stored((1,), None, (5, 6), 2),), 0, 0))
    assert truth.blocks() == 1
    sub = SimpleNamespace(truth=truth)
    source = Source("tcp://127.0.0.1:1")
    asyncio.run(WorkerSubscription._apply(sub, 0, source, 1,  # type: ignore[arg-type]
                                          b"\xc1 not msgpack"))
    assert truth.blocks() == 0 and source.malformed == 1 and source.last_seq == 1


def test_oas_settings_are_typed_flags() -> None:
    import argparse

    from omniinfer.proxy.cli import add_arguments
    from omniinfer.proxy.config import config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--oas-lead-fraction", "0.5", "--oas-hold-bound-cycles", "3",
                              "--oas-batch-tokens", "4096", "--oas-decode-max-running", "7"])
    config = config_from_args(args)
    policy = create_policy("oas", PolicyContext(config, PrefixIndex(), Role.PREFILL))
    assert policy.queue.options.lead_fraction == 0.5
    assert policy.queue.options.bound_cycles == 3.0
    decode = create_policy("oas", PolicyContext(config, PrefixIndex(), Role.DECODE))
    assert decode.decode_cap(Worker("http://127.0.0.1:1", Role.DECODE)) == 7
    with pytest.raises(ValueError):
        RouterConfig(oas_lead_fraction=0.0, worker_urls=["http://h:1"]).validate()


def test_a_client_leaving_as_its_prefill_is_booked_gives_the_booking_back() -> None:
    """The release books the request, then the client's cancellation lands before it resumes:
    before, the booking stayed and the instance never looked idle again."""
    async def run() -> dict[str, Any]:
        policy = _oas(Role.PREFILL)
        p = Worker("http://127.0.0.1:1", Role.PREFILL)
        p.healthy = True
        big = RouteRequest("big", 40000, 8, (), 16)
        assert (await policy.schedule(big, [p])).worker is p  # an idle instance: at once
        waiting = asyncio.ensure_future(policy.schedule(RouteRequest("small", 64, 8), [p]))
        await asyncio.sleep(0)
        assert not waiting.done() and len(policy.queue) == 1  # held behind the big one
        policy.on_prefill_done(big, p, 0.5)  # the pump books "small" for this instance ...
        assert "small" in policy.clock(p).sent
        waiting.cancel()  # ... and its client leaves in the same tick
        with pytest.raises(asyncio.CancelledError):
            await waiting
        return dict(policy.clock(p).sent)

    assert asyncio.run(run()) == {}
