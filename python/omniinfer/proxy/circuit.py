"""Per-worker circuit breaker: stop sending to a worker that keeps failing, probe it later.

closed --(failure_threshold consecutive failures)--> open --(open_secs)--> half-open
half-open --(success_threshold successes)--> closed;  half-open --(any failure)--> open
Pure state machine: the caller passes the clock, so it is tested without waiting.
"""

from __future__ import annotations

import enum


class BreakerState(enum.IntEnum):
    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


class CircuitBreaker:
    __slots__ = ("enabled", "failure_threshold", "success_threshold", "open_secs", "state",
                 "failures", "successes", "opened_at")

    def __init__(self, failure_threshold: int = 5, success_threshold: int = 2,
                 open_secs: float = 30.0, enabled: bool = True) -> None:
        self.enabled = enabled
        self.failure_threshold = max(1, failure_threshold)
        self.success_threshold = max(1, success_threshold)
        self.open_secs = open_secs
        self.state = BreakerState.CLOSED
        self.failures = 0
        self.successes = 0
        self.opened_at = 0.0

    def allows(self, now: float) -> bool:
        """May a request be sent now? Moves open → half-open once the open time has passed."""
        if not self.enabled or self.state == BreakerState.CLOSED:
            return True
        if self.state == BreakerState.OPEN and now - self.opened_at >= self.open_secs:
            self.state = BreakerState.HALF_OPEN
            self.successes = 0
        return self.state == BreakerState.HALF_OPEN

    def record_success(self) -> None:
        self.failures = 0
        if self.state == BreakerState.HALF_OPEN:
            self.successes += 1
            if self.successes >= self.success_threshold:
                self.state = BreakerState.CLOSED

    def record_failure(self, now: float) -> None:
        if not self.enabled:
            return
        self.failures += 1
        if self.state == BreakerState.HALF_OPEN or self.failures >= self.failure_threshold:
            self.state = BreakerState.OPEN
            self.opened_at = now
            self.successes = 0

    def reset(self) -> None:
        self.state = BreakerState.CLOSED
        self.failures = 0
        self.successes = 0
