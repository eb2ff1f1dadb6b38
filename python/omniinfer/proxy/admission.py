"""Bounded admission: at most N requests in flight, a bounded FIFO behind them, 503 past that.

A released slot is handed straight to the oldest waiter, so no request can be overtaken by a
newcomer; a waiter that times out gives up its place. Nothing here blocks a thread.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import math
import time
from collections.abc import Callable


@dataclasses.dataclass
class Rejected(Exception):
    """The router is saturated: answer 503 with ``Retry-After: retry_after`` seconds."""

    reason: str
    retry_after: int = 1
    status: int = 503  # 429 for a rate limit

    def __str__(self) -> str:
        return f"router saturated ({self.reason}); retry after {self.retry_after} s"


class Admission:
    def __init__(self, max_concurrent: int, queue_size: int, queue_timeout_s: float) -> None:
        self.max_concurrent = max_concurrent  # <= 0: unlimited
        self.queue_size = max(0, queue_size)
        self.queue_timeout_s = queue_timeout_s
        self.active = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        if self.max_concurrent <= 0 or (self.active < self.max_concurrent and not self._waiters):
            self.active += 1
            return
        if len(self._waiters) >= self.queue_size:
            raise Rejected("queue_full", self._retry_after())
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self.queue_timeout_s)
        except (asyncio.TimeoutError, asyncio.CancelledError) as exc:
            if waiter.done() and not waiter.cancelled():
                self.release()  # the slot arrived as we gave up: pass it on
            else:
                waiter.cancel()
                try:
                    self._waiters.remove(waiter)
                except ValueError:
                    pass
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise Rejected("queue_timeout", self._retry_after()) from None

    def release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot moves to the waiter; active is unchanged
                return
        self.active = max(0, self.active - 1)

    def _retry_after(self) -> int:
        return max(1, min(60, int(self.queue_timeout_s // 4) or 1))


class RateLimit:
    """``--rate-limit-tokens-per-second``: a token bucket in front of admission.

    Each inference request takes one token; the bucket holds ``capacity`` (sglang-router's:
    ``--max-concurrent-requests``, or one second's worth without a limit) and refills at
    ``rate`` per second. Without a token a request waits for its own (reserved, so waiters are
    served in order) as long as at most ``max_waiting`` others wait and its wait is at most
    ``max_wait_s``; otherwise it is ``Rejected("rate_limited")``. A waiter that gives up hands
    its token back.
    """

    def __init__(self, rate: float, capacity: float, max_waiting: int, max_wait_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not rate > 0 or not capacity >= 1:
            raise ValueError("a rate limit needs a positive rate and a capacity of >= 1")
        self.rate, self.capacity = rate, capacity
        self.max_waiting, self.max_wait_s = max(0, max_waiting), max_wait_s
        self.clock = clock
        self.tokens = capacity
        self.waiting = 0
        self._at = clock()

    def _refill(self) -> None:
        now = self.clock()
        self.tokens = min(self.capacity, self.tokens + (now - self._at) * self.rate)
        self._at = now

    async def take(self) -> None:
        self._refill()
        if self.tokens >= 1:
            self.tokens -= 1
            return
        wait = (1 - self.tokens) / self.rate
        if self.waiting >= self.max_waiting or wait > self.max_wait_s:
            raise Rejected("rate_limited", max(1, min(60, math.ceil(wait))), status=429)
        self.tokens -= 1  # reserved: later arrivals wait behind this one
        self.waiting += 1
        try:
            await asyncio.sleep(wait)
        except asyncio.CancelledError:
            self.tokens += 1
            raise
        finally:
            self.waiting -= 1
