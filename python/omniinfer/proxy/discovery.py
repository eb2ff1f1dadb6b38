"""Kubernetes service discovery (``--service-discovery``), as sglang-router and smg offer it.

The router lists and watches pods through the official Kubernetes client (``kubernetes.aio``:
in-cluster credentials, else the kubeconfig) in ``--service-discovery-namespace`` (all
namespaces without one) and keeps one worker per pod that

- matches ``--selector`` (regular mode) or ``--prefill-selector`` / ``--decode-selector``
  (PD mode; every ``key=value`` must be among the pod's labels),
- is Running and Ready, not being deleted, and has a pod IP;

its URL is ``http://POD_IP:--service-discovery-port``; a prefill pod's bootstrap port is its
``sglang.ai/bootstrap-port`` annotation (the one SGLang's and smg's docs use), else none. A pod
that stops matching (not ready, deleted, relabelled) has its worker removed. Workers named on
the command line or added through the admin API are never removed by discovery.

Adding a worker runs its health check (``Router.add_worker``); one that fails is tried again
on the next event or resync (every ``RESYNC_S``), so a pod that is Ready before its server
answers still joins. The watch restarts from a fresh list every ``WATCH_S`` and after any error
(backing off to ``MAX_BACKOFF_S``). At most ``MAX_PODS`` pods are tracked; a pod list is read
up to ``MAX_LIST_BYTES`` (no pagination) and parsed off the event loop; in PD mode the list is
filtered server-side by the labels both role selectors share, the rest here. ``worker_of`` is
pure; ``Discovery`` owns the loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from omniinfer.proxy.control import read_capped
from omniinfer.proxy.workers import Role

log = logging.getLogger("omniinfer.proxy")
BOOTSTRAP_ANNOTATION = "sglang.ai/bootstrap-port"
RESYNC_S = 5.0
WATCH_S = 300
MAX_BACKOFF_S = 30.0
MAX_PODS = 10_000
MAX_LIST_BYTES = 64 << 20  # one pod list, read whole and parsed off the event loop
ADDS_AT_ONCE = 8  # health checks of new pods running together


@dataclasses.dataclass(frozen=True)
class Discovered:
    url: str
    role: Role
    bootstrap_port: int | None


@dataclasses.dataclass(frozen=True)
class DiscoveryRules:
    """Which pods become which workers (from the flags)."""

    port: int = 80
    namespace: str | None = None
    selector: Mapping[str, str] = dataclasses.field(default_factory=dict)
    prefill_selector: Mapping[str, str] = dataclasses.field(default_factory=dict)
    decode_selector: Mapping[str, str] = dataclasses.field(default_factory=dict)
    pd: bool = False

    def label_selector(self) -> str | None:
        """The server-side filter: the regular selector; in PD mode the labels both role
        selectors share (two selectors cannot be OR-ed in one list call; the rest is filtered
        here), none if they share none."""
        if self.pd:
            common = {k: v for k, v in self.prefill_selector.items()
                      if self.decode_selector.get(k) == v}
        else:
            common = dict(self.selector)
        return ",".join(f"{k}={v}" for k, v in sorted(common.items())) or None


def parse_selector(pairs: Sequence[str] | None, flag: str) -> dict[str, str]:
    """``["app=sglang", "role=prefill"]`` as a dict; ValueError naming ``flag`` if malformed."""
    out: dict[str, str] = {}
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        if not sep or not key or len(key) > 317 or len(value) > 63 or "," in pair:
            raise ValueError(f"{flag}: {pair[:80]!r} is not a label KEY=VALUE")
        out[key] = value
    return out


def _matches(labels: Mapping[str, Any], selector: Mapping[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _ready(status: Mapping[str, Any]) -> bool:
    conditions = status.get("conditions") or []
    return status.get("phase") == "Running" and any(
        isinstance(c, dict) and c.get("type") == "Ready" and c.get("status") == "True"
        for c in conditions)


def worker_of(pod: Any, rules: DiscoveryRules) -> Discovered | None:
    """The worker a pod (the API's JSON object) stands for, or None."""
    if not isinstance(pod, dict):
        return None
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if not isinstance(meta, dict) or not isinstance(status, dict) or meta.get("deletionTimestamp"):
        return None
    labels = meta.get("labels") or {}
    if not isinstance(labels, dict) or not _ready(status):
        return None
    if rules.pd:
        role = Role.PREFILL if _matches(labels, rules.prefill_selector) else \
            Role.DECODE if _matches(labels, rules.decode_selector) else None
    else:
        role = Role.REGULAR if not rules.selector or _matches(labels, rules.selector) else None
    if role is None:
        return None
    try:
        ip = ipaddress.ip_address(str(status.get("podIP", "")))
    except ValueError:
        return None
    host = f"[{ip}]" if ip.version == 6 else str(ip)
    bootstrap = None
    if role is Role.PREFILL:
        annotations = meta.get("annotations") or {}
        raw = annotations.get(BOOTSTRAP_ANNOTATION) if isinstance(annotations, dict) else None
        if isinstance(raw, str) and raw.isdigit() and 0 < int(raw) < 65536:
            bootstrap = int(raw)
    return Discovered(f"http://{host}:{rules.port}", role, bootstrap)


def pod_key(pod: Any) -> str | None:
    meta = pod.get("metadata") if isinstance(pod, dict) else None
    if not isinstance(meta, dict):
        return None
    uid = meta.get("uid") or f"{meta.get('namespace')}/{meta.get('name')}"
    return str(uid)[:256]


class Discovery:
    """The list/watch loop and the reconciliation of the router's worker list.

    ``add(url, role, bootstrap_port)`` and ``remove(url)`` change the router's workers;
    ``api`` is a ``kubernetes.aio.client.CoreV1Api``."""

    def __init__(self, rules: DiscoveryRules, api: Any,
                 add: Callable[[str, Role, int | None], Any], remove: Callable[[str], Any],
                 present: Callable[[str], bool]) -> None:
        self.rules, self.api = rules, api
        self._add, self._remove, self._present = add, remove, present
        self.pods: dict[str, Discovered] = {}  # pod key -> the worker it stands for
        self.owned: dict[str, Discovered] = {}  # workers this loop added, as they were added
        self._adding: dict[str, asyncio.Future[None]] = {}
        self._add_slots = asyncio.Semaphore(ADDS_AT_ONCE)
        self.changed = asyncio.Event()

    async def close(self) -> None:
        for adding in list(self._adding.values()):
            adding.cancel()
        await self.api.api_client.close()

    # ---- reconciliation ----------------------------------------------------------------------
    def apply(self, kind: str, pod: Any) -> None:
        key = pod_key(pod)
        if key is None:
            return
        found = None if kind == "DELETED" else worker_of(pod, self.rules)
        if found is None:
            self.pods.pop(key, None)
        elif key in self.pods or len(self.pods) < MAX_PODS:
            self.pods[key] = found
        self.changed.set()

    def replace_all(self, pods: Sequence[Any]) -> None:
        self.pods.clear()
        for pod in pods:
            self.apply("ADDED", pod)

    async def reconcile(self) -> None:
        """Remove the owned workers whose pod is gone or changed (a reused IP with another role
        or bootstrap port), then start adding the wanted ones, at most ``ADDS_AT_ONCE`` health
        checks at a time; returns without waiting for them."""
        wanted = {d.url: d for d in self.pods.values()}
        for url, had in sorted(self.owned.items(), key=lambda kv: kv[0]):
            if wanted.get(url) == had:
                continue
            del self.owned[url]
            if self._present(url):
                log.info("discovery: removing worker %s (its pod is gone, not ready or "
                         "changed)", url)
                self._remove(url)
        for url, found in wanted.items():
            if url in self.owned or url in self._adding or self._present(url):
                continue
            self._adding[url] = asyncio.ensure_future(self._add_one(url, found))

    async def _add_one(self, url: str, found: Discovered) -> None:
        try:
            async with self._add_slots:
                await self._add(url, found.role, found.bootstrap_port)
            self.owned[url] = found
            log.info("discovery: added %s worker %s", found.role.value, url)
        except ValueError as exc:  # not healthy yet: the next event or resync retries
            log.info("discovery: %s not added yet: %s", url, exc)
        except Exception:  # logged; the next reconciliation tries again
            log.exception("discovery: adding %s failed", url)
        finally:
            self._adding.pop(url, None)

    async def reconcile_loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self.changed.wait(), RESYNC_S)
            except asyncio.TimeoutError:
                pass
            self.changed.clear()
            await self.reconcile()

    # ---- the API -----------------------------------------------------------------------------
    def _call(self) -> tuple[Callable[..., Any], dict[str, Any]]:
        kwargs: dict[str, Any] = {}
        selector = self.rules.label_selector()
        if selector:
            kwargs["label_selector"] = selector
        if self.rules.namespace:
            return self.api.list_namespaced_pod, {"namespace": self.rules.namespace, **kwargs}
        return self.api.list_pod_for_all_namespaces, kwargs

    async def list_once(self) -> str | None:
        """List the pods (replacing what is known); the list's resource version. The answer is
        read up to ``MAX_LIST_BYTES``."""
        func, kwargs = self._call()
        raw = getattr(self.api, func.__name__ + "_without_preload_content")
        response = await raw(**kwargs)
        try:
            if response.status != 200:
                raise RuntimeError(f"pod list answered {response.status}")
            body = await read_capped(response, MAX_LIST_BYTES)
        finally:
            response.release()
        data = await asyncio.get_running_loop().run_in_executor(None, json.loads, body)
        items = data.get("items") if isinstance(data, dict) else None
        self.replace_all(items if isinstance(items, list) else [])
        meta = data.get("metadata") if isinstance(data, dict) else None
        version = meta.get("resourceVersion") if isinstance(meta, dict) else None
        return version if isinstance(version, str) else None

    async def watch_loop(self) -> None:
        from kubernetes.aio import watch

        backoff = 1.0
        while True:
            try:
                version = await self.list_once()
                func, kwargs = self._call()
                async with watch.Watch(return_type="object") as stream:
                    async for event in stream.stream(func, resource_version=version,
                                                     timeout_seconds=WATCH_S, **kwargs):
                        if isinstance(event, dict) and event.get("type") in (
                                "ADDED", "MODIFIED", "DELETED"):
                            self.apply(event["type"], event.get("raw_object"))
                backoff = 1.0
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the API is unreachable or refused us: list again later
                log.warning("discovery: pod watch failed (%s: %s); listing again in %.0f s",
                            exc.__class__.__name__, str(exc)[:200], backoff)
                await asyncio.sleep(backoff)
                backoff = min(MAX_BACKOFF_S, backoff * 2)


async def kube_api() -> Any:
    """A ``CoreV1Api`` with in-cluster credentials, else the kubeconfig's (``KUBECONFIG``)."""
    try:
        from kubernetes.aio import client, config
    except ImportError:
        raise ValueError("--service-discovery needs the Kubernetes client: pip install "
                         "'omniinfer-sglang[k8s]' (or kubernetes>=37)") from None

    settings = client.Configuration()  # this router's own, not the client's global default
    try:
        config.load_incluster_config(client_configuration=settings)
    except config.ConfigException:
        try:
            # KUBECONFIG read now: the client reads it once, when it is imported
            await config.load_kube_config(config_file=os.environ.get("KUBECONFIG"),
                                          client_configuration=settings)
        except (config.ConfigException, OSError) as exc:
            raise ValueError(f"--service-discovery: no Kubernetes credentials (not in a pod, "
                             f"and no usable kubeconfig: {exc})") from None
    return client.CoreV1Api(client.ApiClient(settings))


def rules_from(config: Any) -> DiscoveryRules:
    """The rules a ``RouterConfig`` asks for; ValueError naming the flag if incomplete."""
    rules = DiscoveryRules(
        port=config.service_discovery_port, namespace=config.service_discovery_namespace,
        selector=parse_selector(config.selector, "--selector"),
        prefill_selector=parse_selector(config.prefill_selector, "--prefill-selector"),
        decode_selector=parse_selector(config.decode_selector, "--decode-selector"),
        pd=config.pd_disaggregation)
    if rules.pd and not (rules.prefill_selector and rules.decode_selector):
        raise ValueError("--service-discovery in PD mode needs --prefill-selector and "
                         "--decode-selector")
    if not rules.pd and not rules.selector:
        raise ValueError("--service-discovery needs --selector (which pods are workers)")
    if not 0 < rules.port < 65536:
        raise ValueError("--service-discovery-port must be a port number")
    return rules


async def start(router: Any) -> tuple[Discovery, list[Callable[[], Any]]]:
    """The discovery of ``router`` (a ``core.Router``) and the loops to supervise."""
    api = await kube_api()
    found = Discovery(rules_from(router.config), api, router.add_worker, router.remove_worker,
                      lambda url: router.pool.get(url) is not None)
    return found, [found.watch_loop, found.reconcile_loop]
