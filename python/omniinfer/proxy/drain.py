"""Graceful shutdown: the inference requests in flight, and how the router lets them go.

On SIGTERM the router stops accepting connections and ``Drain.run`` begins: requests that
arrive on connections already open are answered 503 (``draining``), ``/health`` turns 503 so
that a load balancer looks elsewhere, and the requests in flight get ``grace`` seconds to end
on their own. Past that (or at once on a second signal) each one still running is cut: its
handler task is cancelled and marked, and the handler gives it one terminal answer —

- a stream already under way ends with one error event (``type: "shutdown"``) and
  ``data: [DONE]`` (``worker_http.pipe``);
- a request with nothing sent yet gets a 503 JSON error (``forward.handle``);

and its workers are told to abort it. A cancelled task not marked here is a client that went
away, which is answered by nobody. ``Drain`` holds no sockets; it only tracks tasks.
"""

from __future__ import annotations

import asyncio
import logging
import time

log = logging.getLogger("omniinfer.proxy")
CUT_SETTLE_S = 10.0  # how long cut handlers get to write their terminal answer


class Drain:
    """The router's in-flight inference handlers and its shutdown state."""

    def __init__(self) -> None:
        self.draining = False  # set when shutdown begins: new requests are refused
        self._running: set[asyncio.Task[object]] = set()
        self._cut: set[asyncio.Task[object]] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def in_flight(self) -> int:
        return len(self._running)

    def enter(self) -> asyncio.Task[object] | None:
        """Track the calling handler's task until ``leave``."""
        task = asyncio.current_task()
        if task is not None:
            self._running.add(task)
            self._idle.clear()
        return task

    def leave(self, task: asyncio.Task[object] | None) -> None:
        if task is None:
            return
        self._running.discard(task)
        self._cut.discard(task)
        if not self._running:
            self._idle.set()

    def is_cut(self) -> bool:
        """Whether the calling task was cut by the shutdown and has not taken it yet."""
        return asyncio.current_task() in self._cut

    def take_cut(self) -> bool:
        """Whether the calling task was cut by the shutdown (not left by its client); if so its
        cancellation is withdrawn, so that it can still write its terminal answer. Call it in an
        ``except asyncio.CancelledError`` block; true at most once per cut."""
        task = asyncio.current_task()
        if task is None or task not in self._cut:
            return False
        self._cut.discard(task)
        task.uncancel()
        return True

    async def run(self, grace_s: float, hurry: asyncio.Event | None = None) -> int:
        """Refuse new requests, wait up to ``grace_s`` (or until ``hurry`` is set) for the ones in
        flight, then cut the rest and wait up to ``CUT_SETTLE_S`` for their answers. Returns how
        many were cut."""
        self.draining = True
        started = time.monotonic()
        waits = [asyncio.ensure_future(self._idle.wait())]
        if hurry is not None:
            waits.append(asyncio.ensure_future(hurry.wait()))
        try:
            await asyncio.wait(waits, timeout=max(0.0, grace_s),
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in waits:
                waiting.cancel()
        late = list(self._running)
        if late:
            log.warning("shutdown: %d request(s) still running after %.1f s: ending each with "
                        "an error", len(late), time.monotonic() - started)
            for task in late:
                self._cut.add(task)
                task.cancel()
            try:
                await asyncio.wait_for(self._idle.wait(), CUT_SETTLE_S)
            except asyncio.TimeoutError:
                log.warning("shutdown: %d request(s) did not end within %.0f s of being cut",
                            len(self._running), CUT_SETTLE_S)
        return len(late)
