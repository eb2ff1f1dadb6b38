"""Router state and its background work: workers, policies, prefix indexes, health, loads.

A worker's loads come from polling ``/v1/loads`` or, when it advertises one, from SGLang's load
feed (``load_subscriber.py``); either way the policy of its role hears of them (``on_loads``). The
per-request flow is in ``forward.py`` (one ``Request``, ``request.py``) and its attempts in
``attempt.py``, which alone books workers for a request and gives the bookings back; the two
modes are the strategies in ``regular.py`` and ``pd.py``; HTTP routes in ``server.py``.
Everything runs on one asyncio loop; shared state is only touched from it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import os
import secrets
import sys
import time
from collections.abc import Coroutine
from typing import Any

import aiohttp
import orjson

from omniinfer.proxy import discovery
from omniinfer.proxy.admission import Admission, RateLimit
from omniinfer.proxy.cache_truth import CacheTruth, KvLimits, parse_endpoint_overrides
from omniinfer.proxy.circuit import CircuitBreaker
from omniinfer.proxy.config import DEFAULT_REQUEST_ID_HEADERS, RouterConfig
from omniinfer.proxy.control import IDENTITY, control_cap, read_capped, supervise
from omniinfer.proxy.dp import learn_dp_size
from omniinfer.proxy.drain import Drain
from omniinfer.proxy.http1 import Http1Pool
from omniinfer.proxy.listener import Listener
from omniinfer.proxy.load_subscriber import LoadFeeds
from omniinfer.proxy.metrics import AccessLog, ProxyMetrics
from omniinfer.proxy.policy_api import Policy, PolicyContext, create_policy
from omniinfer.proxy.prefix import PrefixIndex, block_hashes
from omniinfer.proxy.tls import worker_context
from omniinfer.proxy.tokenization import (
    ApproxTokenizer,
    Tokenizer,
    load_tokenizer,
    parse_body,
    prompt_tokens,
)
from omniinfer.proxy.tracing import Tracing
from omniinfer.proxy.workers import Role, Worker, WorkerLoads, WorkerPool

log = logging.getLogger("omniinfer.proxy")
JSON_HEADERS = {"Content-Type": "application/json"}


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.pd = config.pd_disaggregation
        self.pool = WorkerPool()
        for url in config.worker_urls:
            self.pool.add(self.make_worker(url, Role.REGULAR))
        for url, port in config.prefill_urls:
            self.pool.add(self.make_worker(url, Role.PREFILL, port))
        for url in config.decode_urls:
            self.pool.add(self.make_worker(url, Role.DECODE))
        self.metrics = ProxyMetrics(self.pool)
        blocks = max(1, config.max_tree_size // config.apc_block_size)
        self.indexes = {role: PrefixIndex(blocks) for role in Role}
        self.cache_truth = CacheTruth(config.cache_truth, config.apc_block_size, self.indexes,
                                      self.get_json,
                                      parse_endpoint_overrides(config.kv_events_endpoints),
                                      config.kv_events_max_dp_size, config.kv_events_max_pages,
                                      max_tokens=config.kv_events_max_tokens,
                                      limits=KvLimits(max_message_bytes=config
                                                      .kv_events_max_message_bytes),
                                      on_failure=self.metrics.task_failed)
        self.load_feeds = LoadFeeds(config.load_feed, self.get_json, self._loads_changed,
                                    config.kv_events_max_dp_size,
                                    on_failure=self.metrics.task_failed)
        self.policies: dict[Role, Policy] = {
            role: create_policy(config.policy_for(role.value),
                                PolicyContext(config, self.indexes[role], role))
            for role in self.roles()
        }
        self.admission = Admission(config.max_concurrent_requests, config.queue_size,
                                   config.queue_timeout_secs)
        self.request_id_headers = tuple(DEFAULT_REQUEST_ID_HEADERS if config.request_id_headers
                                        is None else config.request_id_headers)
        rate = config.rate_limit_tokens_per_second
        self.rate_limit = None if rate is None else RateLimit(
            rate, config.max_concurrent_requests if config.max_concurrent_requests > 0
            else max(1.0, rate), config.queue_size, config.queue_timeout_secs)
        self.access_log = AccessLog(config.access_log, config.access_log_max_bytes,
                                    config.access_log_backups) if config.access_log else None
        self.session_headers = ({"Authorization": f"Bearer {config.api_key}"}
                                if config.api_key else {})
        # control-plane calls: the key (accepted workers only) and the answer's bytes as sent
        self.control_headers = {**IDENTITY, **self.session_headers}
        self.control_cap = control_cap(config.max_response_size)  # bytes of one control answer
        # router rids: a per-process prefix and a counter, all of one length (see new_rids)
        self._rid_prefix = secrets.token_hex(6)
        self._rid_counter = 0
        self._request_ids = itertools.count(1)
        self._tokenize_slots = asyncio.Semaphore(max(1, config.tokenize_concurrency))
        self._tokenize_pool = concurrent.futures.ThreadPoolExecutor(
            max(1, config.tokenize_concurrency), thread_name_prefix="omniproxy-tokenize")
        self.tokenizer: Tokenizer = ApproxTokenizer()
        self.session: aiohttp.ClientSession | None = None  # control plane (health, aborts, ...)
        # the hot path: requests to the workers
        self.worker_tls = worker_context(config.ca_cert_paths, config.client_cert_path,
                                         config.client_key_path)  # for https:// workers
        self.http = Http1Pool(self.session_headers, max_answer_bytes=config.max_response_size,
                              tls=self.worker_tls)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loops: list[asyncio.Task[Any]] = []
        self._loop_ref: asyncio.AbstractEventLoop | None = None
        self.listener: Listener | None = None  # the guarded listening socket (serve_on)
        self.drain = Drain()  # in-flight inference handlers; graceful shutdown
        self.discovery: discovery.Discovery | None = None
        self.tracing = Tracing(config.otlp_traces_endpoint) if config.enable_trace else None

    # ---- set-up -----------------------------------------------------------------------------
    def serve_on(self, listener: Listener) -> None:
        """The guarded listening socket the router serves on (its counters go in describe)."""
        self.listener = listener

    def roles(self) -> tuple[Role, ...]:
        return (Role.PREFILL, Role.DECODE) if self.pd else (Role.REGULAR,)

    def make_worker(self, url: str, role: Role, bootstrap_port: int | None = None) -> Worker:
        c = self.config
        breaker = CircuitBreaker(c.cb_failure_threshold, c.cb_success_threshold,
                                 c.cb_timeout_duration_secs, not c.disable_circuit_breaker)
        return Worker(url, role, bootstrap_port, breaker)

    async def start(self) -> None:
        self._loop_ref = asyncio.get_running_loop()
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=60,
                                         ssl=self.worker_tls)
        # no cookie jar: a Set-Cookie from one worker answer must not ride on every later
        # request (other users'), and an empty jar is still looked up on each request
        # the key rides on each call to an accepted worker, never on a candidate's probe
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                             cookie_jar=aiohttp.DummyCookieJar(),
                                             skip_auto_headers=("User-Agent",))
        await self.check_health(initial=True)
        await asyncio.gather(*(self.learn_ranks(w) for w in self.pool.all()))
        self.tokenizer = await self._find_tokenizer()
        log.info("tokenizer: %s", self.tokenizer.name)
        await asyncio.gather(*(self.cache_truth.attach(w) for w in self.pool.all()),
                             *(self.load_feeds.attach(w) for w in self.pool.all()))
        for url in set(self.cache_truth.explicit) - {w.url for w in self.pool.all()}:
            log.warning("--kv-events-endpoint names %s, which is no worker (yet)", url)
        if not self.config.disable_health_check:
            self._loops.append(asyncio.create_task(
                supervise("health", self._health_loop, self.metrics.task_failed)))
        if self.config.loads_poll_interval_secs > 0:
            self._loops.append(asyncio.create_task(
                supervise("loads", self._loads_loop, self.metrics.task_failed)))
        if self.config.service_discovery:  # workers from Kubernetes pods (``discovery.py``)
            self.discovery, loops = await discovery.start(self)
            self._loops += [asyncio.create_task(supervise(f"discovery-{i}", loop,
                                                          self.metrics.task_failed))
                            for i, loop in enumerate(loops)]

    async def _find_tokenizer(self) -> Tokenizer:
        """The configured tokenizer; else the one a worker reports in /model_info, if local."""
        path = self.config.tokenizer_path or self.config.model_path
        if path is None:
            for worker in self.pool.all():
                info = await self.get_json(worker, "/model_info", timeout=5.0)
                if isinstance(info, dict):
                    for key in ("tokenizer_path", "model_path"):
                        value = info.get(key)
                        if isinstance(value, str) and os.path.isdir(value):
                            path = value
                            break
                if path:
                    break
        if path is None:
            return ApproxTokenizer()
        try:
            return await asyncio.get_running_loop().run_in_executor(None, load_tokenizer, path)
        except Exception as exc:  # a missing tokenizer degrades matching, it does not stop us
            log.warning("could not load tokenizer %s (%s); counting approximate tokens", path, exc)
            return ApproxTokenizer()

    async def close(self) -> None:
        for task in self._loops:
            task.cancel()
        for task in self._loops:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=2.0)
        if self.discovery is not None:
            await self.discovery.close()
        if self.tracing is not None:  # the batched spans go out (bounded), off the loop
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(
                    None, self.tracing.close), 10.0)
        await self.cache_truth.close()
        await self.load_feeds.close()
        if self.session is not None:
            await self.session.close()
        await self.http.close()
        if self.access_log is not None:
            self.access_log.close()
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

    # ---- helpers used by the request flow ---------------------------------------------------
    def spawn(self, coro: Coroutine[Any, Any, Any], name: str | None = None) -> asyncio.Task[Any]:
        """A background task the router keeps a reference to until it ends. With a ``name``
        (fire-and-forget: nobody awaits it) one that raises is logged with its traceback and
        counted (``task_failures{task=name}``); without, its owner reads its outcome."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if name is not None:
            task.add_done_callback(lambda done: self._task_done(done, name))
        return task

    def _task_done(self, task: asyncio.Task[Any], name: str) -> None:
        exc = None if task.cancelled() else task.exception()
        if exc is None:
            return
        log.error("background task %s failed", name, exc_info=(type(exc), exc, exc.__traceback__))
        self.metrics.task_failed(name)

    def new_request_id(self) -> str:
        """The router's own id of a request (policies and the access log): unique per process,
        and cheaper than a uuid4, which reads the OS's random source on every request."""
        return f"r{self._rid_prefix}{next(self._request_ids):x}"

    def new_rids(self, batch: int) -> list[str]:
        """Fresh rids for one attempt: 24 hex characters, then ``-NNNNNN`` per batch prompt.

        SGLang's /abort_request aborts every rid that starts with the given one; rids of equal
        length never start with one another, and a batch's common base is unique to it.
        """
        self._rid_counter += 1
        base = f"{self._rid_prefix}{self._rid_counter & 0xFFFFFFFFFFFF:012x}"
        return [base] if batch == 1 else [f"{base}-{i:06d}" for i in range(batch)]

    def _parse_and_tokenize(self, endpoint: str, raw: bytes
                            ) -> tuple[dict[str, Any], list[list[int]], list[int]]:
        body = parse_body(endpoint, raw)
        prompts = prompt_tokens(endpoint, body, self.tokenizer)
        return body, prompts, block_hashes(prompts[0], self.config.apc_block_size)

    async def tokenize(self, endpoint: str, raw: bytes
                       ) -> tuple[dict[str, Any], list[list[int]], list[int]]:
        """A large body parsed (``parse_body``), its prompts tokenized and the first one's
        block hashes computed, off the loop and at most ``--tokenize-concurrency`` at once: the
        loop never stalls on a large body, and bodies waiting for a slot hold only their bytes.
        A client that leaves while its prompt waits for a slot costs nothing more."""
        await self._tokenize_slots.acquire()
        try:
            job = self._tokenize_pool.submit(self._parse_and_tokenize, endpoint, raw)
        except BaseException:
            self._tokenize_slots.release()
            raise
        # the slot stays taken until the thread is done, even if the awaiting client left
        job.add_done_callback(lambda _: self._loop_release())
        return await asyncio.wrap_future(job)

    def _loop_release(self) -> None:
        loop = self._loop_ref
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._tokenize_slots.release)

    def record_failure(self, worker: Worker, kind: str) -> None:
        worker.breaker.record_failure(time.monotonic())
        self.metrics.upstream_error(worker.url, worker.role.value, kind)

    def abort(self, worker: Worker, rids: list[str], cause: str) -> None:
        """Fire-and-forget ``POST /abort_request {"rid": ...}`` (SGLang's abort by request id)."""
        if not rids:
            return
        # a batch shares a unique base: one prefix abort reaches all its prompts
        targets = rids if len(rids) == 1 else [rids[0].rsplit("-", 1)[0]]
        for rid in targets:
            self.metrics.aborts.labels(worker.role.value, cause).inc()
            self.spawn(self._post_abort(worker, rid), "abort")

    async def _post_abort(self, worker: Worker, rid: str) -> None:
        assert self.session is not None
        try:
            async with self.session.post(
                    worker.url + "/abort_request", data=orjson.dumps({"rid": rid}),
                    headers={**JSON_HEADERS, **self.control_headers},
                    timeout=aiohttp.ClientTimeout(total=5.0)) as resp:
                await read_capped(resp, self.control_cap)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            log.info("abort %s at %s failed: %s", rid, worker.url, exc)

    async def get_json(self, worker: Worker, path: str, timeout: float) -> Any:
        """GET ``path`` and decode JSON; None on any failure (an answer over the control cap
        included)."""
        assert self.session is not None
        try:
            async with self.session.get(worker.url + path, headers=self.control_headers,
                                        timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                if resp.status != 200:
                    return None
                return orjson.loads(await read_capped(resp, self.control_cap))
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, orjson.JSONDecodeError):
            return None

    # ---- health and loads -------------------------------------------------------------------
    async def _probe(self, worker: Worker, accepted: bool = True) -> bool:
        """The health check; a candidate (``accepted=False``) is not shown the worker key."""
        assert self.session is not None
        try:
            async with self.session.get(
                    worker.url + self.config.health_check_endpoint,
                    headers=self.control_headers if accepted else IDENTITY,
                    timeout=aiohttp.ClientTimeout(total=self.config.health_check_timeout_secs)
            ) as resp:
                await read_capped(resp, self.control_cap)
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    def apply_health(self, worker: Worker, ok: bool, initial: bool = False) -> None:
        """Eject after ``health_failure_threshold`` failures, re-admit after the success one."""
        c = self.config
        if ok:
            worker.health_failures = 0
            worker.health_successes += 1
            if not worker.healthy and (initial or worker.health_successes >= c.health_success_threshold):
                worker.healthy = True
                worker.breaker.reset()
                if not self.cache_truth.follows(worker):  # (events tell a restart themselves)
                    self.indexes[worker.role].clear(worker.url)  # a restarted worker has no cache
                if not initial:
                    log.warning("worker re-admitted: %s", worker.url)
                    if self.cache_truth.enabled and not self.cache_truth.follows(worker):
                        self.spawn(self.cache_truth.attach(worker), "cache_truth_attach")
                    if not self.load_feeds.live(worker):  # it may publish elsewhere now
                        self.load_feeds.detach(worker)
                        self.spawn(self.load_feeds.attach(worker), "load_feed_attach")
                    if self.config.dp_aware:  # it may have restarted with another --dp-size
                        self.spawn(self.learn_ranks(worker), "dp_ranks")
        else:
            worker.health_successes = 0
            worker.health_failures += 1
            if worker.healthy and worker.health_failures >= c.health_failure_threshold:
                worker.healthy = False
                log.warning("worker ejected after %d failed health checks: %s",
                            worker.health_failures, worker.url)

    async def check_health(self, initial: bool = False, only_unhealthy: bool = False) -> None:
        workers = [w for w in self.pool.all() if not (only_unhealthy and w.healthy)]
        if not workers:
            return
        results = await asyncio.gather(*(self._probe(w) for w in workers))
        for worker, ok in zip(workers, results, strict=True):
            if self.pool.get(worker.url) is worker:
                self.apply_health(worker, ok, initial)

    async def _health_loop(self) -> None:
        interval = max(0.05, self.config.health_check_interval_secs)
        tick = min(interval, 1.0)
        last_full = time.monotonic()
        while True:
            await asyncio.sleep(tick)
            full = time.monotonic() - last_full >= interval
            if full:
                last_full = time.monotonic()
            await self.check_health(only_unhealthy=not full)

    async def poll_loads(self) -> None:
        """Poll /v1/loads of every healthy worker whose load feed is not live."""
        workers = [w for w in self.pool.all()
                   if w.healthy and w.loads_supported and not self.load_feeds.live(w)]
        results = await asyncio.gather(*(self._poll_one(w) for w in workers))
        for worker, data in zip(workers, results, strict=True):
            if data is None or self.load_feeds.live(worker):  # the feed spoke meanwhile
                continue
            worker.loads = WorkerLoads.from_json(data, time.time())
            self._loads_changed(worker)

    def _loads_changed(self, worker: Worker) -> None:
        """``worker.loads`` is new (a poll or its load feed): the policy of its role hears it."""
        if self.pool.get(worker.url) is not worker:
            return
        policy = self.policies.get(worker.role)
        if policy is not None:
            try:
                policy.on_loads(worker)
            except Exception:  # noqa: BLE001 - one worker's loads must not stop the others'
                log.exception("policy %s failed on the loads of %s", policy.name, worker.url)
                self.metrics.task_failed("on_loads")

    async def learn_ranks(self, worker: Worker) -> None:
        """``--dp-aware``: the worker's DP rank count from its ``/server_info`` (``dp.py``)."""
        if self.config.dp_aware:
            learn_dp_size(worker, await self.get_json(worker, "/server_info", 10.0))

    async def _poll_one(self, worker: Worker) -> Any:
        assert self.session is not None
        try:
            async with self.session.get(worker.url + "/v1/loads?include=core",
                                        headers=self.control_headers,
                                        timeout=aiohttp.ClientTimeout(total=2.0)) as resp:
                if resp.status == 404:
                    worker.loads_supported = False
                    return None
                if resp.status != 200:
                    return None
                return orjson.loads(await read_capped(resp, self.control_cap))
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, orjson.JSONDecodeError):
            return None

    async def _loads_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.loads_poll_interval_secs)
            await self.poll_loads()

    # ---- admin ------------------------------------------------------------------------------
    async def add_worker(self, url: str, role: Role, bootstrap_port: int | None) -> Worker:
        if role not in self.roles():
            raise ValueError(f"role {role.value!r} is not served in "
                             f"{'PD' if self.pd else 'regular'} mode")
        worker = self.make_worker(url, role, bootstrap_port)
        if self.pool.get(worker.url) is not None:
            raise ValueError(f"worker already registered: {worker.url}")
        if not await self._probe(worker, accepted=False):
            raise ValueError(f"worker {worker.url} failed its health check; not added")
        self.apply_health(worker, True, initial=True)
        if self.pool.get(worker.url) is not None:  # added concurrently meanwhile
            raise ValueError(f"worker already registered: {worker.url}")
        await self.learn_ranks(worker)
        self.pool.add(worker)
        self.policies[role].on_workers_changed(self.pool.role(role))
        await self.cache_truth.attach(worker)
        await self.load_feeds.attach(worker)
        return worker

    def remove_worker(self, url: str) -> Worker:
        worker = self.pool.get(url)
        if worker is None:
            raise KeyError(url)
        self.pool.remove(worker.url)
        self.metrics.forget_worker(worker)
        self.cache_truth.detach(worker)
        self.load_feeds.detach(worker)
        self.indexes[worker.role].clear(worker.url)
        self.http.drop(worker.url)
        self.policies[worker.role].on_workers_changed(self.pool.role(worker.role))
        return worker

    def ready(self) -> bool:
        now = time.monotonic()
        return all(self.pool.candidates(role, now) for role in self.roles())

    def describe(self) -> dict[str, Any]:
        return {
            "mode": "pd" if self.pd else "regular",
            "policies": {role.value: p.name for role, p in self.policies.items()},
            "tokenizer": self.tokenizer.name,
            "apc_block_size": self.config.apc_block_size,
            "cache_truth": self.cache_truth.describe(),
            "load_feed": self.load_feeds.describe(),
            "cache_prediction": {label: tally.as_dict()
                                 for label, tally in self.metrics.predictions.items()},
            "admission": {"active": self.admission.active, "queued": self.admission.queued,
                          "max_concurrent": self.config.max_concurrent_requests,
                          "queue_size": self.config.queue_size},
            "connections": self.listener.describe() if self.listener is not None else None,
            "workers": [w.describe() for w in self.pool.all()],
            "policy_state": {role.value: state for role, p in self.policies.items()
                             if (state := p.describe()) is not None},
            "tables": self.table_sizes(),
        }

    def table_sizes(self) -> dict[str, Any]:
        """Entries of every structure that grows with traffic, each bounded (a soak watches
        them against the process's RSS)."""
        index = {role.value: {"blocks": {url: idx.size(url) for url in idx.keys()},
                              "distinct": idx.distinct(), "cap_per_worker": idx.max_blocks}
                 for role, idx in self.indexes.items() if idx.distinct()}
        return {"prefix_index": index, "background_tasks": len(self._tasks),
                "metric_series": self.metrics.series(),
                # live Python objects' memory blocks: RSS keeps its high-water mark, this does not
                "python_allocated_blocks": sys.getallocatedblocks()}
