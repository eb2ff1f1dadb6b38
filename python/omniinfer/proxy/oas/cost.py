"""OAS cost model, pure: per-instance batch time learned online, and predicted TTFT.

An instance's prefill batch time is modelled as linear in a few features of the batch —
``base + per_request·n + per_token·tokens + attention·Σ tokens_j²`` — and fitted by recursive
least squares with forgetting, starting from a prior. The prior's per-token term may be seeded
from the worker's cumulative busy time per uncached token (``/v1/loads`` or the load feed), but
only before the first measured batch and only once those totals cover ``MIN_SEED_TOKENS``
tokens: a report taken while a pass runs counts the pass's tokens before its time. Batches are
found from response timing, as OmniInfer's proxy finds them: prefill completions close
together belong to one batch; a batch started when the previous one ended, or when its first
request was sent if the instance was idle.

The instance's own report (nothing waiting) grants a *credit* of one batch of tokens that may be
sent regardless of the predicted queue, so a wrong model cannot leave an instance without work
while requests wait in the router (see ``deferred_queue``).

Predicted TTFT of a request on an instance = the time until the instance has worked off what is
already sent to it (queue) + the batch time of the request's *uncached* tokens + the KV
transfer of its prompt. Nothing here does I/O; times are seconds on any monotonic clock.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Sequence

import numpy as np

TOKEN_UNIT = 1000.0  # features in thousands of tokens keep the least squares well conditioned
SQUARE_UNIT = 1e6
MIN_SEED_TOKENS = 8 * 16384  # eight full batches (SGLang's default max_prefill_tokens)


def features(tokens: Sequence[int]) -> np.ndarray:
    """(1, requests, tokens/1e3, Σ tokens²/1e6) of one batch of per-request uncached tokens."""
    total = float(sum(tokens))
    square = float(sum(t * t for t in tokens))
    return np.array([1.0, float(len(tokens)), total / TOKEN_UNIT, square / SQUARE_UNIT])


@dataclasses.dataclass
class BatchTimeModel:
    """Recursive least squares with forgetting over ``features``; never predicts below zero.

    ``theta`` holds (base s, per-request s, s per 1K tokens, s per 1M token²). The prior's
    covariance says how far the first measurements may move each coefficient.
    """

    theta: np.ndarray = dataclasses.field(
        default_factory=lambda: np.array([0.005, 0.0002, 0.03, 0.0]))
    forgetting: float = 0.99
    prior_variance: tuple[float, float, float, float] = (1e-4, 1e-6, 1e-2, 1e-3)
    samples: int = 0
    version: int = 0  # changes whenever theta does (for callers that cache predictions)

    def __post_init__(self) -> None:
        self.theta = np.asarray(self.theta, dtype=float).copy()
        self.cov = np.diag(np.asarray(self.prior_variance, dtype=float))

    def seed_per_token(self, busy_seconds: float, tokens: int) -> None:
        """Set the per-token coefficient from reported totals (before any measurement).

        Only totals over ``MIN_SEED_TOKENS`` count: a report taken while a pass runs includes
        the tokens of that pass but not yet its time, an error that only many batches dilute.
        """
        if tokens < MIN_SEED_TOKENS or not busy_seconds > 0:
            return
        seconds_per_token = busy_seconds / tokens
        if self.samples == 0 and math.isfinite(seconds_per_token):
            self.theta[2] = seconds_per_token * TOKEN_UNIT
            self.version += 1
            self.cov[2, 2] = max(self.cov[2, 2], self.theta[2] ** 2)

    def predict(self, tokens: Sequence[int]) -> float:
        if not tokens:
            return 0.0
        return max(0.0, float(features(tokens) @ self.theta))

    def update(self, tokens: Sequence[int], seconds: float) -> None:
        """One measured batch: ``tokens`` computed per request took ``seconds``."""
        if not tokens or not seconds > 0 or not math.isfinite(seconds):
            return
        x = features(tokens)
        px = self.cov @ x
        gain = px / (self.forgetting + float(x @ px))
        self.theta = self.theta + gain * (seconds - float(x @ self.theta))
        self.cov = (self.cov - np.outer(gain, px)) / self.forgetting
        self.cov = (self.cov + self.cov.T) / 2.0  # keep it symmetric against rounding drift
        self.samples += 1
        self.version += 1

    def per_token(self) -> float:
        """Marginal seconds per uncached token (at no attention cost)."""
        return max(1e-9, float(self.theta[2]) / TOKEN_UNIT)


@dataclasses.dataclass(slots=True)
class Sent:
    """One request sent to an instance and not yet back from prefill."""

    key: str
    tokens: int  # uncached tokens the instance must compute
    sent_at: float


@dataclasses.dataclass
class Batch:
    start: float
    end: float
    tokens: list[int]
    floor: float = 0.0  # the previous batch's end: this one cannot have started before it

    @property
    def seconds(self) -> float:
        return self.end - self.start


class InstanceClock:
    """What the router has sent one instance, and its batch rhythm learned from completions.

    ``gap`` is how close two completions must be to count as one batch (OmniInfer's: 20 ms for
    prefill); it shrinks with the learned cycle so that a sped-up clock still separates batches.
    """

    def __init__(self, key: str = "", model: BatchTimeModel | None = None,
                 gap: float = 0.020, ring: int = 8) -> None:
        self.key = key
        self.model = model or BatchTimeModel()
        self.max_gap = gap
        self.sent: dict[str, Sent] = {}
        self.busy_since: float | None = None  # start of the batch now running (predicted)
        self.last_end: float | None = None
        self.cycle: float | None = None  # running mean of batch durations
        self.batch_tokens: float | None = None  # running mean of tokens per batch
        self._open: Batch | None = None
        self.ring = ring
        self.by_size: dict[int, collections.deque[float]] = {}  # OmniInfer's per-size ring
        self.credit_tokens = 0.0  # may be sent despite the predicted queue (reported empty)
        self._work: tuple[int, float] | None = None  # (model version, predicted s of all sent)

    # ---- bookkeeping ------------------------------------------------------------------------
    def on_sent(self, key: str, tokens: int, now: float) -> None:
        self.sent[key] = Sent(key, max(0, tokens), now)
        self._work = None
        if self.busy_since is None:
            self.busy_since = now
        self.credit_tokens = max(0.0, self.credit_tokens - max(1, tokens))

    def on_report(self, waiting_requests: int, default_batch_tokens: float = 1.0) -> None:
        """The worker's own queue as it reported it: nothing waiting grants one batch of credit.

        Nothing waiting means the next batch would hold at most the chunk now running, whatever
        the model predicts; the credit (the mean tokens per measured batch) fills that batch.
        Anything waiting withdraws it. The report may predate our last sends, so the credit is
        bounded by one batch per report.
        """
        if waiting_requests > 0:
            self.credit_tokens = 0.0
        else:
            self.credit_tokens = max(self.batch_tokens or 0.0, default_batch_tokens, 1.0)

    def starved(self) -> bool:
        """Reported without waiting work and not yet refilled since (see ``on_report``)."""
        return self.credit_tokens > 0

    def on_done(self, key: str, now: float) -> Batch | None:
        """A prefill finished; returns the batch it closed, if any (for tests and metrics)."""
        item = self.sent.pop(key, None)
        if item is None:
            return None
        self._work = None
        closed = None
        gap = self.gap()
        if self._open is not None and now - self._open.end <= gap:
            batch = self._open
            batch.end = now
            batch.tokens.append(item.tokens)
            batch.start = max(batch.floor, min(batch.start, item.sent_at))
        else:
            closed = self._close()
            floor = self.last_end if self.last_end is not None else item.sent_at
            self._open = Batch(max(floor, item.sent_at), now, [item.tokens], floor)
        self.last_end = now
        self.busy_since = now if self.sent else None
        return closed

    def on_failed(self, key: str) -> None:
        self.sent.pop(key, None)
        self._work = None
        if not self.sent:
            self.busy_since = None

    def _close(self) -> Batch | None:
        batch, self._open = self._open, None
        if batch is None or batch.seconds <= 0:
            return None
        self.model.update(batch.tokens, batch.seconds)
        ring = self.by_size.setdefault(len(batch.tokens), collections.deque(maxlen=self.ring))
        ring.append(batch.seconds)
        self.cycle = batch.seconds if self.cycle is None else 0.8 * self.cycle + 0.2 * batch.seconds
        total = float(sum(batch.tokens))
        self.batch_tokens = total if self.batch_tokens is None else (
            0.8 * self.batch_tokens + 0.2 * total)
        return batch

    def gap(self) -> float:
        """Completions closer than this are one batch (at most a quarter of a cycle)."""
        return self.max_gap if self.cycle is None else min(self.max_gap, 0.25 * self.cycle)

    # ---- predictions ------------------------------------------------------------------------
    def is_idle(self) -> bool:
        return not self.sent

    def ring_seconds(self, size: int) -> float | None:
        """Mean measured duration of batches of ``size`` requests (nearest size measured)."""
        if not self.by_size:
            return None
        nearest = min(self.by_size, key=lambda s: (abs(s - size), s))
        ring = self.by_size[nearest]
        return sum(ring) / len(ring)

    def backlog_tokens(self) -> int:
        return sum(s.tokens for s in self.sent.values())

    def queue_seconds(self, now: float) -> float:
        """Predicted time until everything sent so far has finished prefill."""
        if not self.sent:
            return 0.0
        if self._work is None or self._work[0] != self.model.version:
            # asked once per waiting request and instance on every pump: predict once
            self._work = (self.model.version,
                          self.model.predict([s.tokens for s in self.sent.values()]))
        work = self._work[1]
        started = self.busy_since if self.busy_since is not None else now
        return max(0.0, work - (now - started))

    def cycle_seconds(self, default: float) -> float:
        return self.cycle if self.cycle is not None else default

    def describe(self) -> dict[str, float | int | None]:
        return {"sent": len(self.sent), "backlog_tokens": self.backlog_tokens(),
                "cycle_s": self.cycle, "batch_tokens": self.batch_tokens,
                "per_token_s": self.model.per_token(), "samples": self.model.samples,
                "credit_tokens": self.credit_tokens}


@dataclasses.dataclass(frozen=True)
class TransferModel:
    """KV transfer seconds for a prompt; learned scale, zero until known."""

    latency_s: float = 0.0
    seconds_per_token: float = 0.0

    def seconds(self, prompt_tokens: int) -> float:
        return self.latency_s + self.seconds_per_token * prompt_tokens


def predicted_ttft(clock: InstanceClock, uncached_tokens: int, prompt_tokens: int, now: float,
                   transfer: TransferModel = TransferModel(), use_cache: bool = True) -> float:
    """Queue + prefill of the uncached tokens (all tokens with ``use_cache`` off) + transfer."""
    compute = uncached_tokens if use_cache else prompt_tokens
    return (clock.queue_seconds(now) + clock.model.predict([max(1, compute)])
            + transfer.seconds(prompt_tokens))


class ObservedDelay:
    """How much longer than their own predicted compute recent requests took from release to
    the end of their prefill: the queue they met at the instance, the batch they finished
    with, and the model's error, as measured rather than predicted.

    ``released`` books a request (its predicted compute on the instance it went to); ``done``
    closes it and keeps the excess (never below zero) among the last ``window`` ones;
    ``value`` is their ``quantile`` (zero until ``min_samples`` are known). Requests closed
    without a measurement (failed, cancelled) are ``forget``-ten. At most ``max_open``
    requests are booked at once: beyond that the oldest booking is dropped, so a caller that
    never closes cannot grow it without bound.
    """

    def __init__(self, window: int = 64, quantile: float = 0.9, min_samples: int = 8,
                 max_open: int = 65536) -> None:
        if not 0.0 <= quantile <= 1.0 or window < 1 or max_open < 1:
            raise ValueError("ObservedDelay: window >= 1, max_open >= 1, 0 <= quantile <= 1")
        self.quantile = quantile
        self.min_samples = min_samples
        self.max_open = max_open
        self.recent: collections.deque[float] = collections.deque(maxlen=window)
        self._open: dict[str, tuple[float, float]] = {}  # key -> (released at, predicted s)
        self._value: float | None = 0.0

    def released(self, key: str, now: float, predicted_s: float) -> None:
        if len(self._open) >= self.max_open:
            self._open.pop(next(iter(self._open)))
        self._open[key] = (now, max(0.0, predicted_s))

    def done(self, key: str, now: float) -> None:
        booked = self._open.pop(key, None)
        if booked is None:
            return
        released_at, predicted = booked
        self.recent.append(max(0.0, now - released_at - predicted))
        self._value = None

    def forget(self, key: str) -> None:
        self._open.pop(key, None)

    @property
    def booked(self) -> int:
        """Requests released and not yet closed."""
        return len(self._open)

    def value(self) -> float:
        if self._value is None:
            if len(self.recent) < self.min_samples:
                self._value = 0.0
            else:
                ordered = sorted(self.recent)
                self._value = ordered[min(len(ordered) - 1,
                                          int(self.quantile * (len(ordered) - 1) + 0.5))]
        return self._value
