"""Prometheus metrics of the router (its own registry, served at /metrics) and the access log.

The series every request touches (requests, phases, TTFT/TPOT/E2E, routing decisions, cache
prediction) are plain counts read into prometheus families at scrape time: prometheus_client's
own Counter and Histogram take a lock per increment and walk the buckets in Python, about a
fifth of the router's own CPU time per request. Only the router's event loop writes them.
"""

from __future__ import annotations

import bisect
import os
import time
from collections.abc import Iterator, Sequence
from typing import IO, Any

import orjson
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from omniinfer.proxy.accuracy import Tally
from omniinfer.proxy.request import PHASE_NAMES, Lifecycle
from omniinfer.proxy.workers import Worker, WorkerPool

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                   5.0, 10.0, 30.0, 60.0, 120.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.0)


class WorkerCollector(Collector):
    """Per-worker load read from the pool at scrape time (nothing to update per request)."""

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[GaugeMetricFamily]:
        specs = (
            ("omniproxy_worker_inflight_tokens", "tokens of routed requests not yet finished",
             lambda w: w.inflight_tokens),
            ("omniproxy_worker_inflight_requests", "routed requests not yet finished",
             lambda w: w.inflight_requests),
            ("omniproxy_worker_queue_requests", "waiting requests reported by /v1/loads",
             lambda w: w.loads.waiting_reqs),
            ("omniproxy_worker_running_requests", "running requests reported by /v1/loads",
             lambda w: w.loads.running_reqs),
            ("omniproxy_worker_kv_usage", "KV cache token usage reported by /v1/loads",
             lambda w: w.loads.token_usage),
            ("omniproxy_worker_healthy", "1 if the worker passes health checks",
             lambda w: 1.0 if w.healthy else 0.0),
            ("omniproxy_worker_circuit_state", "0 closed, 1 open, 2 half-open",
             lambda w: float(w.breaker.state)),
        )
        workers = self.pool.all()
        for name, doc, read in specs:
            family = GaugeMetricFamily(name, doc, labels=["worker", "role"])
            for w in workers:
                family.add_metric([w.url, w.role.value], float(read(w)))
            yield family


class FastCounter(Collector):
    """A labelled counter as a dict of label values to totals (bounded label sets only)."""

    def __init__(self, name: str, doc: str, labels: Sequence[str]) -> None:
        self.name, self.doc, self.labels = name, doc, list(labels)
        self.values: dict[tuple[str, ...], float] = {}

    def inc(self, labels: tuple[str, ...], amount: float = 1.0) -> None:
        self.values[labels] = self.values.get(labels, 0.0) + amount

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.doc, labels=self.labels)
        for labels, value in self.values.items():
            family.add_metric(list(labels), value)
        yield family


class HistogramSeries:
    """One histogram series: a count per bucket (the last one +Inf) and the sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # first bound >= value
        self.sum += value


class FastHistogram(Collector):
    """Histogram series by label values, exposed exactly as prometheus_client's Histogram."""

    def __init__(self, name: str, doc: str, bounds: tuple[float, ...],
                 labels: Sequence[str] = ()) -> None:
        self.name, self.doc, self.bounds, self.labels = name, doc, bounds, list(labels)
        self.series: dict[tuple[str, ...], HistogramSeries] = {}
        self._les = [floatToGoString(b) for b in bounds] + ["+Inf"]

    def child(self, *labels: str) -> HistogramSeries:
        series = self.series.get(labels)
        if series is None:
            series = self.series[labels] = HistogramSeries(self.bounds)
        return series

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.doc, labels=self.labels)
        for labels, series in self.series.items():
            total, buckets = 0, []
            for le, count in zip(self._les, series.counts, strict=True):
                total += count
                buckets.append((le, float(total)))
            family.add_metric(list(labels), buckets, series.sum)
        yield family


class ProxyMetrics:
    def __init__(self, pool: WorkerPool) -> None:
        disable_created_metrics()  # the *_created series only add noise to each scrape
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = FastCounter("omniproxy_requests", "answered requests",
                                    ["endpoint", "status"])
        self.phase = FastHistogram("omniproxy_phase_duration_seconds",
                                   "time in each request phase", LATENCY_BUCKETS, ["phase"])
        self._phase = {name: self.phase.child(name) for name in PHASE_NAMES}
        self.ttft = FastHistogram("omniproxy_ttft_seconds", "time to first token through the "
                                  "router", LATENCY_BUCKETS)
        self.tpot = FastHistogram("omniproxy_tpot_seconds", "time per output token after the "
                                  "first", TPOT_BUCKETS)
        self.e2e = FastHistogram("omniproxy_e2e_seconds", "request latency through the router",
                                 LATENCY_BUCKETS)
        self._ttft, self._tpot, self._e2e = self.ttft.child(), self.tpot.child(), self.e2e.child()
        self.decisions = FastCounter("omniproxy_routing_decisions", "routing decisions",
                                     ["policy", "role", "reason"])
        self.retries = Counter("omniproxy_retries", "retried upstream attempts", ["role", "cause"],
                               registry=r)
        self.upstream_errors = Counter("omniproxy_upstream_errors", "failed upstream attempts",
                                       ["worker", "role", "kind"], registry=r)
        self.aborts = Counter("omniproxy_upstream_aborts", "abort_request sent to a worker",
                              ["role", "cause"], registry=r)
        self.rejected = Counter("omniproxy_admission_rejected", "requests answered 503",
                                ["reason"], registry=r)
        self.admission_active = Gauge("omniproxy_admission_active", "requests holding a slot",
                                      registry=r)
        self.admission_queued = Gauge("omniproxy_admission_queued", "requests waiting for a slot",
                                      registry=r)
        # predicted vs reported cached tokens, by what filled the chosen worker's index
        self.cache_prediction = FastCounter(
            "omniproxy_cache_prediction", "predicted cached tokens vs the worker's report: exact "
            "(to whole blocks), over or under", ["cache_truth", "outcome"])
        self.cache_prediction_unreported = FastCounter(
            "omniproxy_cache_prediction_unreported", "answers that reported no cached tokens",
            ["cache_truth"])
        self.cache_prediction_error = FastCounter(
            "omniproxy_cache_prediction_error_tokens", "sum of |predicted - reported| cached tokens",
            ["cache_truth"])
        self.cache_predicted_tokens = FastCounter(
            "omniproxy_cache_predicted_tokens", "sum of predicted cached tokens (reported answers)",
            ["cache_truth"])
        self.cache_reported_tokens = FastCounter(
            "omniproxy_cache_reported_tokens", "sum of cached tokens the workers reported",
            ["cache_truth"])
        # a background loop or task that raised (it was logged and restarted)
        self.task_failures = FastCounter(
            "omniproxy_background_task_failures", "background tasks that raised (logged with "
            "the traceback; a loop is restarted)", ["task"])
        self.predictions: dict[str, Tally] = {}
        self._error_series: set[tuple[str, str, str]] = set()
        for collector in (self.requests, self.phase, self.ttft, self.tpot, self.e2e,
                          self.decisions, self.cache_prediction, self.cache_prediction_unreported,
                          self.cache_prediction_error, self.cache_predicted_tokens,
                          self.cache_reported_tokens, self.task_failures):
            r.register(collector)
        r.register(WorkerCollector(pool))

    def series(self) -> int:
        """Labelled series of the per-request families (bounded label sets)."""
        return sum(len(c.values) for c in (
            self.requests, self.decisions, self.cache_prediction, self.cache_prediction_unreported,
            self.cache_prediction_error, self.cache_predicted_tokens, self.cache_reported_tokens,
            self.task_failures)
        ) + sum(len(h.series) for h in (self.phase, self.ttft, self.tpot, self.e2e)) + len(
            self._error_series)

    def decision(self, policy: str, role: str, reason: str) -> None:
        self.decisions.inc((policy, role, reason))

    def task_failed(self, task: str) -> None:
        """A background task named ``task`` raised (a fixed set of names: bounded series)."""
        self.task_failures.inc((task,))

    def upstream_error(self, worker: str, role: str, kind: str) -> None:
        self._error_series.add((worker, role, kind))
        self.upstream_errors.labels(worker, role, kind).inc()

    def forget_worker(self, worker: Worker) -> None:
        """Drop a removed worker's series (else every worker ever added stays in /metrics)."""
        for key in [k for k in self._error_series if k[0] == worker.url]:
            self._error_series.discard(key)
            self.upstream_errors.remove(*key)

    def observe(self, endpoint: str, status: int, life: Lifecycle) -> None:
        self.requests.inc((endpoint, str(status)))
        phase = self._phase
        for name, seconds in life.durations().items():
            phase[name].observe(seconds)
        if status == 200:
            ttft, e2e, tpot = life.ttft(), life.e2e(), life.tpot()
            if ttft is not None:
                self._ttft.observe(ttft)
            if e2e is not None:
                self._e2e.observe(e2e)
            if tpot is not None:
                self._tpot.observe(tpot)

    def observe_prediction(self, truth: str, predicted: int, reported: int | None,
                           block_size: int = 1) -> str:
        """One routed request's predicted cached tokens against the worker's answer."""
        result = self.predictions.setdefault(truth, Tally()).add(predicted, reported, block_size)
        key = (truth,)
        if reported is None:
            self.cache_prediction_unreported.inc(key)
            return result
        self.cache_prediction.inc((truth, result))
        self.cache_prediction_error.inc(key, abs(predicted - reported))
        self.cache_predicted_tokens.inc(key, predicted)
        self.cache_reported_tokens.inc(key, reported)
        return result

    def render(self) -> bytes:
        return generate_latest(self.registry)


class AccessLog:
    """One JSON line per answered request; buffered, flushed at most every second, rotated
    past ``max_bytes`` (``path.1`` .. ``path.N``, the oldest dropped)."""

    def __init__(self, path: str, max_bytes: int = 256 << 20, backups: int = 3) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        self._file: IO[bytes] = open(path, "ab", buffering=1 << 16)
        self._size = self._file.tell()
        self._flushed = time.monotonic()

    def write(self, record: dict[str, Any]) -> None:
        # a client rid sits as deep here as in the body, which orjson re-encoded already
        line = orjson.dumps(record, default=str, option=orjson.OPT_APPEND_NEWLINE)
        self._file.write(line)
        self._size += len(line)
        now = time.monotonic()
        if self._size >= self.max_bytes:
            self._rotate()
        elif now - self._flushed > 1.0:
            self._file.flush()
            self._flushed = now

    def flush(self) -> None:
        self._file.flush()

    def _rotate(self) -> None:
        self._file.close()
        for i in range(self.backups, 0, -1):
            source = self.path if i == 1 else f"{self.path}.{i - 1}"
            if os.path.exists(source):
                os.replace(source, f"{self.path}.{i}")
        if self.backups == 0:
            os.remove(self.path)
        self._file = open(self.path, "ab", buffering=1 << 16)
        self._size = 0

    def close(self) -> None:
        self._file.close()
