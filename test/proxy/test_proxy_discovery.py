"""Kubernetes service discovery through the official client (``kubernetes.aio``) against
``FakeKubeApi`` (pods list and watch): pods added, made ready, made not ready and deleted join
and leave the router's workers within 2 s, prefill pods with the bootstrap port of their
annotation; pods of other labels never join; workers given on the command line stay. Also the
pure mapping of a pod to a worker and the flag checks."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from fake_kube_api import FakeKubeApi, recorded_pod

from omniinfer.child_process import free_port
from omniinfer.proxy.config import RouterConfig
from omniinfer.proxy.discovery import (
    DiscoveryRules,
    parse_selector,
    worker_of,
)
from omniinfer.proxy.server import open_router
from omniinfer.proxy.workers import Role

PREFILL = {"app": "sglang", "component": "prefill"}
DECODE = {"app": "sglang", "component": "decode"}


async def _health_server(host: str, port: int) -> TestServer:
    app = web.Application()
    app.router.add_get("/health", lambda r: web.json_response({"status": "ok"}))
    server = TestServer(app, host=host, port=port)
    await server.start_server()
    return server


async def _fake_api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeKubeApi:
    """A started FakeKubeApi that the client's kubeconfig names (not in a pod)."""
    fake = FakeKubeApi()
    await fake.start()
    monkeypatch.setenv("KUBECONFIG", str(fake.kubeconfig(tmp_path / "kubeconfig")))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    return fake


async def _within(check: Any, seconds: float = 2.0) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while loop.time() < deadline:
        if check():
            return True
        await asyncio.sleep(0.02)
    return bool(check())


def test_pods_join_and_leave_within_two_seconds(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    async def run() -> None:
        fake = await _fake_api(tmp_path, monkeypatch)
        port = free_port()
        workers = [await _health_server(f"127.0.0.{i}", port) for i in (2, 3, 4, 5)]
        config = RouterConfig(pd_disaggregation=True, service_discovery=True,
                              prefill_selector=[f"{k}={v}" for k, v in PREFILL.items()],
                              decode_selector=[f"{k}={v}" for k, v in DECODE.items()],
                              service_discovery_port=port,
                              service_discovery_namespace="inference", host="127.0.0.1",
                              port=free_port(), prometheus_port=0, loads_poll_interval_secs=0,
                              disable_health_check=True)
        serving = await open_router(config)
        router = serving.router
        urls = lambda: {(w.url, w.role, w.bootstrap_port) for w in router.pool.all()}  # noqa: E731
        try:
            assert urls() == set()
            prefill = recorded_pod("p0", "127.0.0.2", PREFILL, ready=False,
                                   annotations={"sglang.ai/bootstrap-port": "9101"})
            await fake.put(prefill)
            await asyncio.sleep(0.5)
            assert urls() == set()  # not ready: not a worker
            await fake.put(recorded_pod("p0", "127.0.0.2", PREFILL, ready=True,
                                        annotations={"sglang.ai/bootstrap-port": "9101"}))
            await fake.put(recorded_pod("d0", "127.0.0.3", DECODE))
            await fake.put(recorded_pod("other", "127.0.0.4", {"app": "web"}))
            await fake.put(recorded_pod("d1", "127.0.0.5", DECODE, namespace="elsewhere"))
            want = {(f"http://127.0.0.2:{port}", Role.PREFILL, 9101),
                    (f"http://127.0.0.3:{port}", Role.DECODE, None)}
            assert await _within(lambda: urls() == want), urls()
            assert router.ready()
            await fake.delete("p0")
            assert await _within(lambda: urls() == {(f"http://127.0.0.3:{port}", Role.DECODE,
                                                     None)}), urls()
            await fake.put(recorded_pod("d0", "127.0.0.3", DECODE, ready=False))
            assert await _within(lambda: urls() == set()), urls()
            assert fake.watches >= 1  # changes came through the watch, not only lists
        finally:
            await serving.close()
            for w in workers:
                await w.close()
            await fake.close()

    asyncio.run(run())


def test_a_ready_pod_whose_server_is_not_up_yet_joins_when_it_answers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def run() -> None:
        fake = await _fake_api(tmp_path, monkeypatch)
        port = free_port()
        config = RouterConfig(service_discovery=True, selector=["app=sglang"],
                              service_discovery_port=port, host="127.0.0.1", port=free_port(),
                              prometheus_port=0, loads_poll_interval_secs=0,
                              disable_health_check=True)
        serving = await open_router(config)
        worker = None
        try:
            await fake.put(recorded_pod("w0", "127.0.0.6", {"app": "sglang"}))
            await asyncio.sleep(0.5)
            assert serving.router.pool.all() == []  # its health check fails: not yet
            worker = await _health_server("127.0.0.6", port)
            assert await _within(lambda: len(serving.router.pool.all()) == 1, 8.0)
        finally:
            await serving.close()
            if worker is not None:
                await worker.close()
            await fake.close()

    asyncio.run(run())


def test_pod_to_worker() -> None:
    pod = json.loads((Path(__file__).resolve().parents[1] / "data" / "k8s"
                      / "pod-sglang-prefill.json").read_text())
    pd = DiscoveryRules(port=30000, prefill_selector={"component": "prefill"},
                        decode_selector={"component": "decode"}, pd=True)
    found = worker_of(pod, pd)
    assert found is not None and found.url == "http://10.244.1.23:30000"
    assert found.role is Role.PREFILL and found.bootstrap_port == 8998
    assert worker_of(pod, DiscoveryRules(port=80, selector={"app": "sglang"})).role is Role.REGULAR
    assert worker_of(pod, DiscoveryRules(selector={"app": "other"})) is None
    six = json.loads(json.dumps(pod))
    six["status"]["podIP"] = "fd00::17"
    assert worker_of(six, pd).url == "http://[fd00::17]:30000"
    for change in ({"status": {"phase": "Pending"}},
                   {"metadata": {"deletionTimestamp": "2026-12-04T10:00:00Z"}},
                   {"status": {"podIP": "not-an-ip"}},
                   {"status": {"podIP": ""}}):
        bad = json.loads(json.dumps(pod))
        for part, fields in change.items():
            bad[part].update(fields)
        assert worker_of(bad, pd) is None, change
    odd = json.loads(json.dumps(pod))
    odd["metadata"]["annotations"] = {"sglang.ai/bootstrap-port": "99999"}
    assert worker_of(odd, pd).bootstrap_port is None  # out of range: none
    assert worker_of("not a pod", pd) is None and worker_of({"metadata": 3}, pd) is None


@pytest.mark.parametrize(("settings", "message"), [
    ({"selector": []}, "needs --selector"),
    ({"selector": ["app"]}, "--selector"),
    ({"pd_disaggregation": True, "prefill_selector": ["a=b"]}, "--decode-selector"),
    ({"selector": ["app=x"], "service_discovery_port": 70000}, "port"),
])
def test_discovery_flags_are_checked(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RouterConfig(service_discovery=True, **settings).validate()
    assert parse_selector(["a=b", "c="], "--selector") == {"a": "b", "c": ""}


def test_pd_lists_filter_server_side_by_the_shared_labels() -> None:
    rules = DiscoveryRules(prefill_selector={"app": "sglang", "component": "prefill"},
                           decode_selector={"app": "sglang", "component": "decode"}, pd=True)
    assert rules.label_selector() == "app=sglang"
    assert DiscoveryRules(prefill_selector={"a": "1"}, decode_selector={"b": "2"},
                          pd=True).label_selector() is None
    assert DiscoveryRules(selector={"x": "y", "a": "b"}).label_selector() == "a=b,x=y"
