"""Bounded admission: at most N requests in flight, a bounded FIFO behind them, 503 past that.

A released slot is handed straight to the oldest waiter, so no request can be overtaken by a
newcomer; a waiter that times out gives up its place. Nothing here blocks a thread.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses


@dataclasses.dataclass
class Rejected(Exception):
    """The router is saturated: answer 503 with ``Retry-After: retry_after`` seconds."""

    reason: str
    retry_after: int = 1

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
