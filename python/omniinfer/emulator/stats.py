"""What an emulated worker counts: pass counters, token totals and SGLang's latency histograms.

Bucket bounds are SGLang 0.5.23's defaults (``observability/metrics_collector.py``), so a
dashboard built for the real server reads the emulator's ``/metrics`` unchanged. The series
SGLang splits by ``is_streaming`` are kept per value of that label (``"true"``/``"false"``).
"""

from __future__ import annotations

import bisect
import dataclasses

from omniinfer.emulator.request import EmuRequest

TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0,
                200.0, 400.0)
ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060,
               0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.0, 2.0, 4.0, 6.0, 8.0)
E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0,
               200.0, 400.0, 600.0, 1200.0, 1800.0, 2400.0)
QUEUE_TIME_BUCKETS = (0.0, 0.001, 0.005, 0.010, 0.050, 0.100, 0.200, 0.500, 1.0, 2.0, 3.0, 4.0, 5.0,
                      10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0, 100.0, 200.0, 300.0,
                      400.0, 500.0, 600.0, 700.0, 800.0, 900.0, 1000.0, 1200.0, 1400.0, 1600.0,
                      1800.0, 2000.0, 2500.0, 3000.0)


class Histogram:
    """A Prometheus histogram with fixed buckets (cheap observe; ``counts[i]`` is not cumulative)."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1  # bucket i holds value <= bound i
        self.total += value
        self.count += 1

    def cumulative(self) -> list[tuple[float, int]]:
        """``(upper bound, observations <= bound)`` for each finite bucket."""
        out, running = [], 0
        for bound, n in zip(self.buckets, self.counts, strict=False):
            running += n
            out.append((bound, running))
        return out


@dataclasses.dataclass
class FinishedStats:
    """SGLang's per-request series of one ``is_streaming`` value, counted when a request finishes."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests: int = 0
    ttft: Histogram = dataclasses.field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    e2e: Histogram = dataclasses.field(default_factory=lambda: Histogram(E2E_BUCKETS))


@dataclasses.dataclass
class EngineStats:
    prompt_tokens_total: int = 0  # at admission (the load report's uncached-token figure)
    generation_tokens_total: int = 0
    cached_tokens_total: int = 0
    num_requests_total: int = 0
    num_retractions_total: int = 0
    prefill_passes: int = 0
    decode_steps: int = 0
    prefill_busy_s: float = 0.0
    decode_busy_s: float = 0.0
    itl: Histogram = dataclasses.field(default_factory=lambda: Histogram(ITL_BUCKETS))
    queue_time: Histogram = dataclasses.field(default_factory=lambda: Histogram(QUEUE_TIME_BUCKETS))
    by_stream: dict[str, FinishedStats] = dataclasses.field(
        default_factory=lambda: {"false": FinishedStats(), "true": FinishedStats()})

    def observe_ttft(self, request: EmuRequest, seconds: float) -> None:
        self.by_stream[_label(request)].ttft.observe(seconds)

    def observe_finished(self, request: EmuRequest, e2e_s: float) -> None:
        stats = self.by_stream[_label(request)]
        stats.prompt_tokens += request.prompt_tokens
        stats.generation_tokens += len(request.output_ids)
        stats.requests += 1
        stats.e2e.observe(e2e_s)


def _label(request: EmuRequest) -> str:
    return "true" if request.stream else "false"
