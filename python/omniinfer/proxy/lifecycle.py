"""The eight request phases of the paper, each timestamped, as the router can observe them.

Phase boundaries the router sees:
  tokenize           request arrived → prompt tokenized
  apc_matching       → prefix blocks hashed and matched against each worker's index
  prefill_waiting    → admitted and a (prefill) worker picked (router queue + policy)
  prefill_scheduled  → posted to the (prefill) worker, until its response headers
  prefill_running    → the worker accepted it, until prefill is done (regular: first token;
                       PD: the prefill response completed)
  decode_waiting     PD: prefill done, the decode worker waits for the KV transfer
  decode_scheduled   PD: decode worker answered headers after prefill finished
  decode_running     first output token → last byte
Phases are entered in order; a phase entered after a later one is ignored (in PD the two
workers' events race), and a phase never entered has no duration.
"""

from __future__ import annotations

import enum
import time


class Phase(enum.IntEnum):
    TOKENIZE = 0
    APC_MATCHING = 1
    PREFILL_WAITING = 2
    PREFILL_SCHEDULED = 3
    PREFILL_RUNNING = 4
    DECODE_WAITING = 5
    DECODE_SCHEDULED = 6
    DECODE_RUNNING = 7


PHASE_NAMES: tuple[str, ...] = tuple(p.name.lower() for p in Phase)
_NO_MARKS: tuple[None, ...] = (None,) * len(Phase)  # len(Phase) is a Python-level call


class Lifecycle:
    """Monotonic enter times of each phase plus first-token and finish times."""

    __slots__ = ("request_id", "arrival", "arrival_wall", "marks", "last", "first_token",
                 "finished", "output_tokens")

    def __init__(self, request_id: str, now: float | None = None) -> None:
        self.request_id = request_id
        self.arrival = time.perf_counter() if now is None else now
        self.arrival_wall = time.time()
        self.marks: list[float | None] = list(_NO_MARKS)
        self.last = -1
        self.first_token: float | None = None
        self.finished: float | None = None
        self.output_tokens = 0

    def enter(self, phase: Phase, now: float | None = None) -> bool:
        """Mark ``phase`` entered; False (and no change) if a later phase was entered already."""
        if phase <= self.last:
            return False
        self.marks[phase] = time.perf_counter() if now is None else now
        self.last = int(phase)
        return True

    def token(self, now: float | None = None) -> None:
        """An output token reached the client; the first one starts decode_running."""
        t = time.perf_counter() if now is None else now
        if self.first_token is None:
            self.first_token = t
            self.enter(Phase.DECODE_RUNNING, t)

    def finish(self, now: float | None = None) -> None:
        if self.finished is None:
            self.finished = time.perf_counter() if now is None else now

    def durations(self) -> dict[str, float]:
        """Seconds spent in each entered phase (ends at the next entered phase or finish)."""
        out: dict[str, float] = {}
        entered = [(i, t) for i, t in enumerate(self.marks) if t is not None]
        end = self.finished
        for k, (i, t) in enumerate(entered):
            stop = entered[k + 1][1] if k + 1 < len(entered) else end
            if stop is not None:
                out[PHASE_NAMES[i]] = max(0.0, stop - t)
        return out

    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    def e2e(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival

    def tpot(self) -> float | None:
        if self.first_token is None or self.finished is None or self.output_tokens < 2:
            return None
        return (self.finished - self.first_token) / (self.output_tokens - 1)

    def timestamps(self) -> dict[str, float]:
        """Wall-clock enter time of each entered phase (for the access log)."""
        base = self.arrival_wall - self.arrival
        return {PHASE_NAMES[i]: round(base + t, 6) for i, t in enumerate(self.marks)
                if t is not None}
