"""FakeKubeApi: a stand-in for the Kubernetes API server's pod list and watch endpoints, not
an API server. Enough of ``GET /api/v1/pods`` and ``GET /api/v1/namespaces/NS/pods`` (equality
``labelSelector``, ``watch``, ``resourceVersion``, ``timeoutSeconds``) for the official client's
``list_*_pod`` and ``Watch().stream`` to run against it; the test changes pods with ``put``
and ``delete`` and every change is one watch event."""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer

POD_FILE = Path(__file__).resolve().parents[1] / "data" / "k8s" / "pod-sglang-prefill.json"


def recorded_pod(name: str, ip: str, labels: dict[str, str], ready: bool = True,
                 annotations: dict[str, str] | None = None,
                 namespace: str = "inference") -> dict[str, Any]:
    """The recorded pod with another name, IP, labels, readiness and annotations."""
    pod = json.loads(POD_FILE.read_text())
    meta = pod["metadata"]
    meta.update(name=name, namespace=namespace, uid=f"uid-{namespace}-{name}", labels=labels,
                annotations=annotations or {})
    pod["status"]["podIP"] = ip
    pod["status"]["podIPs"] = [{"ip": ip}]
    for condition in pod["status"]["conditions"]:
        if condition["type"] in ("Ready", "ContainersReady"):
            condition["status"] = "True" if ready else "False"
    return pod


def _selected(pod: dict[str, Any], selector: str) -> bool:
    labels = pod["metadata"].get("labels") or {}
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


class FakeKubeApi:
    def __init__(self) -> None:
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.events: list[tuple[int, str, dict[str, Any]]] = []
        self.version = 100
        self.changed = asyncio.Condition()
        self.server: TestServer | None = None
        self.watches = 0

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.port}"

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/api/v1/pods", self._pods)
        app.router.add_get("/api/v1/namespaces/{namespace}/pods", self._pods)
        self.server = TestServer(app, host="127.0.0.1")
        await self.server.start_server()
        return self.url

    async def close(self) -> None:
        if self.server is not None:
            await self.server.close()

    def kubeconfig(self, path: Path) -> Path:
        """A kubeconfig naming this server (token auth, no TLS)."""
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": "fake-token"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}]}))
        return path

    async def _record(self, kind: str, pod: dict[str, Any]) -> None:
        async with self.changed:
            self.version += 1
            pod = copy.deepcopy(pod)
            pod["metadata"]["resourceVersion"] = str(self.version)
            key = (pod["metadata"]["namespace"], pod["metadata"]["name"])
            if kind == "DELETED":
                self.pods.pop(key, None)
            else:
                self.pods[key] = pod
            self.events.append((self.version, kind, pod))
            self.changed.notify_all()

    async def put(self, pod: dict[str, Any]) -> None:
        key = (pod["metadata"]["namespace"], pod["metadata"]["name"])
        await self._record("MODIFIED" if key in self.pods else "ADDED", pod)

    async def delete(self, name: str, namespace: str = "inference") -> None:
        await self._record("DELETED", self.pods[(namespace, name)])

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        namespace = request.match_info.get("namespace")
        selector = request.query.get("labelSelector", "")

        def wanted(pod: dict[str, Any]) -> bool:
            return (namespace is None or pod["metadata"]["namespace"] == namespace) \
                and _selected(pod, selector)

        if request.query.get("watch") not in ("true", "1", "True"):
            return web.json_response({"kind": "PodList", "apiVersion": "v1",
                                      "metadata": {"resourceVersion": str(self.version)},
                                      "items": [p for p in self.pods.values() if wanted(p)]})
        self.watches += 1
        since = int(request.query.get("resourceVersion") or self.version)
        timeout = float(request.query.get("timeoutSeconds") or 300)
        out = web.StreamResponse(headers={"Content-Type": "application/json"})
        await out.prepare(request)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            async with self.changed:
                if self.version <= since:
                    try:
                        await asyncio.wait_for(self.changed.wait(), deadline - loop.time())
                    except asyncio.TimeoutError:
                        break
                batch = [(kind, pod) for version, kind, pod in self.events
                         if version > since and wanted(pod)]
                since = self.version
            for kind, pod in batch:
                await out.write(json.dumps({"type": kind, "object": pod}).encode() + b"\n")
        await out.write_eof()
        return out
