"""``/metrics`` of an emulated worker: the series SGLang 0.5.23 exports, read from the engine.

A ``prometheus_client`` custom collector on a private registry renders them, so HELP/TYPE lines
and label escaping are right by construction. Names, help texts and label names are SGLang's
(``sglang/srt/observability/metrics_collector.py`` and ``http_request_metrics.py``); a test
checks them against the installed package. Scheduler series carry the scheduler's labels,
request series the tokenizer's (plus ``is_streaming`` or ``cache_source`` where SGLang adds
them), HTTP series ``endpoint`` and ``method``.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from omniinfer.emulator.engine import EmulatedEngine
from omniinfer.emulator.stats import Histogram
from omniinfer.emulator.status import WorkerInfo, utilization

SCHEDULER_LABELS = ("model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank")
TOKENIZER_LABELS = ("model_name", "engine_type")

# name -> SGLang's help text, in the order SGLang declares them
SCHEDULER_GAUGES = {
    "num_running_reqs": "The number of running requests.",
    "num_queue_reqs": "The number of requests in the waiting queue.",
    "gen_throughput": "The generation throughput (token/s).",
    "cache_hit_rate": "The prefix cache hit rate.",
    "token_usage": "The token usage.",
    "full_token_usage": "The token usage for full attention layers.",
    "num_used_tokens": "The number of used tokens.",
    "kv_available_tokens": "Number of free token slots in the KV cache pool.",
    "kv_evictable_tokens": "Number of evictable (radix-cached) token slots in the KV cache pool.",
    "kv_used_tokens": "Number of actively used token slots in the KV cache pool.",
    "num_retracted_reqs": "The number of retracted requests.",
    "num_prefill_bootstrap_queue_reqs": "The number of requests in the prefill bootstrap queue.",
    "num_prefill_inflight_queue_reqs": "The number of requests in the prefill inflight queue.",
    "num_decode_prealloc_queue_reqs": "The number of requests in the decode prealloc queue.",
    "num_decode_transfer_queue_reqs": "The number of requests in the decode transfer queue.",
    "utilization": "The utilization.",
    "new_token_ratio": "The new token ratio.",
    "max_total_num_tokens": "Maximum total number of tokens in the KV cache pool.",
    "page_size": "KV cache page size in tokens.",
}
HELP = {
    "queue_time_seconds": "Histogram of queueing time in seconds.",
    "prompt_tokens_total": "Number of prefill tokens processed.",
    "generation_tokens_total": "Number of generation tokens processed.",
    "cached_tokens_total": "Number of cached prompt tokens by source (device/host/storage).",
    "num_requests_total": "Number of requests processed.",
    "time_to_first_token_seconds": "Histogram of time to first token in seconds.",
    "inter_token_latency_seconds": "Histogram of inter-token latency in seconds.",
    "e2e_request_latency_seconds": "Histogram of End-to-end request latency in seconds",
    "http_requests_total": "Total number of HTTP requests by endpoint and method",
    "http_responses_total": "Total number of HTTP responses by endpoint and status code",
    "http_requests_active": "Number of currently active HTTP requests",
}


class HttpCounters:
    """SGLang's HTTP series: requests, responses by status, requests in flight, per route."""

    def __init__(self) -> None:
        self.requests: collections.Counter[tuple[str, str]] = collections.Counter()
        self.responses: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self.active: collections.Counter[tuple[str, str]] = collections.Counter()

    def started(self, endpoint: str, method: str) -> None:
        self.requests[(endpoint, method)] += 1
        self.active[(endpoint, method)] += 1

    def finished(self, endpoint: str, method: str, status: int | None) -> None:
        self.active[(endpoint, method)] -= 1
        if status is not None:  # None: the handler failed before any answer (client gone)
            self.responses[(endpoint, str(status), method)] += 1


class EmulatorCollector(Collector):
    """Builds every series at scrape time from the engine, the worker's identity and HTTP counts."""

    def __init__(self, info: WorkerInfo, engine: EmulatedEngine, http: HttpCounters) -> None:
        self.info = info
        self.engine = engine
        self.http = http

    def collect(self) -> Iterator[Metric]:
        name = self.info.profile.model.served_model_name
        sched = [name, self.info.engine_type, "0", "0", "0"]
        tok = [name, self.info.engine_type]
        for key, value in self._gauges().items():
            family = GaugeMetricFamily(f"sglang:{key}", SCHEDULER_GAUGES[key], labels=SCHEDULER_LABELS)
            family.add_metric(sched, float(value))
            yield family
        s = self.engine.stats
        yield _histogram("queue_time_seconds", SCHEDULER_LABELS, [(sched, s.queue_time)])
        for key, attr in (("prompt_tokens_total", "prompt_tokens"),
                          ("generation_tokens_total", "generation_tokens"),
                          ("num_requests_total", "requests")):
            counter = CounterMetricFamily(f"sglang:{key}", HELP[key], labels=[*TOKENIZER_LABELS, "is_streaming"])
            for stream, finished in s.by_stream.items():
                counter.add_metric([*tok, stream], float(getattr(finished, attr)))
            yield counter
        cached = CounterMetricFamily("sglang:cached_tokens_total", HELP["cached_tokens_total"],
                                     labels=[*TOKENIZER_LABELS, "cache_source"])
        cached.add_metric([*tok, "device"], float(s.cached_tokens_total))
        yield cached
        streams = list(s.by_stream.items())
        yield _histogram("time_to_first_token_seconds", [*TOKENIZER_LABELS, "is_streaming"],
                         [([*tok, k], v.ttft) for k, v in streams])
        yield _histogram("inter_token_latency_seconds", TOKENIZER_LABELS, [(tok, s.itl)])
        yield _histogram("e2e_request_latency_seconds", [*TOKENIZER_LABELS, "is_streaming"],
                         [([*tok, k], v.e2e) for k, v in streams])
        yield from self._http()

    def _gauges(self) -> dict[str, float]:
        e, kv, info = self.engine, self.engine.kv, self.info
        used = kv.used()
        return {
            "num_running_reqs": e.num_running(),
            "num_queue_reqs": e.num_waiting(),
            "gen_throughput": e.gen_throughput(),
            "cache_hit_rate": e.cache_hit_rate(),
            "token_usage": used / kv.capacity,
            "full_token_usage": used / kv.capacity,
            "num_used_tokens": used,
            "kv_available_tokens": kv.capacity - used,
            "kv_evictable_tokens": kv.evictable(),
            "kv_used_tokens": used,
            "num_retracted_reqs": 0,
            "num_prefill_bootstrap_queue_reqs": 0,
            "num_prefill_inflight_queue_reqs": len(e.held),
            "num_decode_prealloc_queue_reqs": len(e.bootstrapping),
            "num_decode_transfer_queue_reqs": len(e.transferring),
            "utilization": utilization(info, e),
            "new_token_ratio": info.profile.capacity.new_token_ratio,
            "max_total_num_tokens": kv.capacity,
            "page_size": 1,
        }

    def _http(self) -> Iterator[Metric]:
        h = self.http
        requests = CounterMetricFamily("sglang:http_requests_total", HELP["http_requests_total"],
                                       labels=["endpoint", "method"])
        for (endpoint, method), n in sorted(h.requests.items()):
            requests.add_metric([endpoint, method], float(n))
        yield requests
        responses = CounterMetricFamily("sglang:http_responses_total", HELP["http_responses_total"],
                                        labels=["endpoint", "status_code", "method"])
        for key, n in sorted(h.responses.items()):
            responses.add_metric(list(key), float(n))
        yield responses
        active = GaugeMetricFamily("sglang:http_requests_active", HELP["http_requests_active"],
                                   labels=["endpoint", "method"])
        for (endpoint, method), n in sorted(h.active.items()):
            active.add_metric([endpoint, method], float(n))
        yield active


def _histogram(key: str, labels: list[str] | tuple[str, ...],
               series: list[tuple[list[str], Histogram]]) -> HistogramMetricFamily:
    family = HistogramMetricFamily(f"sglang:{key}", HELP[key], labels=labels)
    for values, h in series:
        buckets = [(floatToGoString(bound), float(n)) for bound, n in h.cumulative()]
        buckets.append(("+Inf", float(h.count)))
        family.add_metric(values, buckets, sum_value=h.total)
    return family


class WorkerMetrics:
    """The private registry of one worker; ``render`` is the ``/metrics`` body."""

    content_type = "text/plain; version=0.0.4; charset=utf-8"

    def __init__(self, info: WorkerInfo, engine: EmulatedEngine) -> None:
        self.http = HttpCounters()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EmulatorCollector(info, engine, self.http))

    def render(self) -> bytes:
        return generate_latest(self.registry)
