"""Control-plane plumbing: worker answers read under a size cap, background loops supervised.

Every control answer a worker sends (health probes, ``/v1/loads`` polls, ``get_json``,
aborts, ``/flush_cache``, the relayed info routes) is read with :func:`read_capped`: at most
``cap`` bytes are kept (a declared larger ``Content-Length`` fails at once; a chunked body fails
as soon as it passes the cap), so an endless ``/v1/models`` costs a few chunks of memory, not the
process. The cap is ``control_cap(config)``: ``min(--max-response-size, CONTROL_ANSWER_CAP)``.

Every long-running task runs under a :class:`Supervisor` (the router's loops through
:func:`supervise`, the ZMQ readers directly): an exception is logged with its traceback, counted
(``omniproxy_background_task_failures_total{task}``), and the task starts again after a backoff
(doubling, reset after a quiet minute). :class:`WarningLimiter` keeps what a worker sends from
flooding the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

log = logging.getLogger("omniinfer.proxy")
CONTROL_ANSWER_CAP = 1 << 20  # /server_info of SGLang 0.5.23 is about 40 KB
CHUNK = 1 << 16
IDENTITY = {"Accept-Encoding": "identity"}  # bytes as sent: the cap counts what is kept
FIRST_BACKOFF_S = 0.1
MAX_BACKOFF_S = 5.0


class AnswerTooLarge(aiohttp.ClientPayloadError):
    """A worker's control answer passed the cap (a ClientError: callers treat it as a failure)."""


def control_cap(max_response_size: int) -> int:
    """The byte cap of one control answer, given ``--max-response-size``."""
    return max(1, min(max_response_size, CONTROL_ANSWER_CAP))


async def read_capped(resp: aiohttp.ClientResponse, cap: int) -> bytes:
    """The whole body of ``resp`` if it is at most ``cap`` bytes, else ``AnswerTooLarge``.

    Reads in chunks and stops at the first byte past the cap (the connection is closed, not
    drained); never holds more than ``cap`` plus one chunk."""
    if resp.content_length is not None and resp.content_length > cap:
        resp.close()
        raise AnswerTooLarge(f"answer of {resp.content_length} bytes; at most {cap} read")
    body = bytearray()
    while chunk := await resp.content.read(CHUNK):
        body += chunk
        if len(body) > cap:
            resp.close()
            raise AnswerTooLarge(f"answer larger than {cap} bytes")
    return bytes(body)


class OwnedTasks:
    """Mixin: the tasks in ``self._tasks`` are the object's own; ``cancel`` stops them and
    ``close`` waits until they have ended."""

    _tasks: list[asyncio.Task[Any]]

    def cancel(self) -> None:
        for task in self._tasks:
            task.cancel()

    async def close(self) -> None:
        self.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


class WarningLimiter:
    """Warnings about what a peer sends, limited per key (a source and a kind of fault).

    Contract: the first warning of a key is logged at once; later ones at most once per
    ``every_s``, each carrying the number suppressed since the last one logged. Keys are
    forgotten wholesale past ``max_keys`` (keys name endpoints, so this does not happen in
    practice). ``warn`` returns whether it logged."""

    def __init__(self, every_s: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 max_keys: int = 4096) -> None:
        self.every_s = every_s
        self.clock = clock
        self.max_keys = max_keys
        self._keys: dict[str, list[float]] = {}  # key -> [next time one is logged, suppressed]

    def warn(self, logger: logging.Logger, key: str, message: str, *args: Any,
             level: int = logging.WARNING, exc_info: bool = False) -> bool:
        now = self.clock()
        state = self._keys.get(key)
        if state is not None and now < state[0]:
            state[1] += 1
            return False
        if state is not None and state[1]:
            message += " (%d similar suppressed in the last %.0f s)"
            args = (*args, int(state[1]), self.every_s)
        if state is None and len(self._keys) >= self.max_keys:
            self._keys.clear()
        self._keys[key] = [now + self.every_s, 0]
        logger.log(level, message, *args, exc_info=exc_info)
        return True


FailureHook = Callable[[str], None]


class Supervisor:
    """Runs a reader's session for ever: when it raises, the failure is counted (``failed``),
    logged with its traceback (rate-limited per endpoint), reported to ``on_failure`` (the
    reader's kind, e.g. for a metric) and the session restarted after a backoff that doubles
    up to ``max_backoff_s`` and starts over once a session has run a minute. A session that
    returns (its connection ended: the peer closed it, or it broke a bound such as a message
    over the size limit, and a session is one connection) is started again after ``RESTART_S``, no failure counted. Cancellation
    ends it. A failing ``on_failure`` is logged, never propagated."""

    RESTART_S = 0.1

    def __init__(self, kind: str, on_failure: FailureHook | None = None,
                 backoff_s: float = 1.0, max_backoff_s: float = 30.0,
                 limiter: WarningLimiter | None = None) -> None:
        self.kind = kind
        self.on_failure = on_failure
        self.backoff_s = backoff_s
        self.max_backoff_s = max(backoff_s, max_backoff_s)
        self.limiter = limiter or WarningLimiter()

    async def run(self, endpoint: str, session: Callable[[], Awaitable[None]],
                  failed: Callable[[], None]) -> None:
        delay = self.backoff_s
        while True:
            started = time.monotonic()
            try:
                await session()
                delay = self.backoff_s
                await asyncio.sleep(self.RESTART_S)
                continue
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug, a broken socket, a peer we did not foresee
                if time.monotonic() - started > 60.0:
                    delay = self.backoff_s
                try:
                    failed()
                except Exception:  # noqa: BLE001 - counting must not kill the reader
                    log.exception("%s %s: noting a failure failed", self.kind, endpoint)
                self.limiter.warn(log, f"failed {endpoint}", "%s %s: reader failed; restarting "
                                  "in %.1f s", self.kind, endpoint, delay, level=logging.ERROR,
                                  exc_info=True)
                if self.on_failure is not None:
                    try:
                        self.on_failure(self.kind)
                    except Exception:  # noqa: BLE001 - a hook must not kill the reader
                        log.exception("%s %s: failure hook failed", self.kind, endpoint)
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.max_backoff_s)

    def watch(self, task: asyncio.Task[None], endpoint: str) -> asyncio.Task[None]:
        """Log (and report) a reader task that ends other than by cancellation: ``run`` should
        make that impossible, so it names a bug (or a BaseException such as SystemExit)."""

        def ended(done: asyncio.Task[None]) -> None:
            if done.cancelled():
                return
            exc = done.exception()
            log.error("%s %s: reader ended: %r", self.kind, endpoint, exc, exc_info=exc)
            if self.on_failure is not None:
                with contextlib.suppress(Exception):
                    self.on_failure(self.kind)

        task.add_done_callback(ended)
        return task


async def supervise(name: str, body: Callable[[], Awaitable[None]],
                    on_failure: FailureHook) -> None:
    """Run the router's loop ``body`` for ever under a :class:`Supervisor` named ``name``:
    a failure is logged with its traceback, reported as ``on_failure(name)`` and ``body``
    restarted after a backoff (``FIRST_BACKOFF_S`` doubling up to ``MAX_BACKOFF_S``); a return
    restarts it too. Cancellation ends it."""
    supervisor = Supervisor(name, on_failure, FIRST_BACKOFF_S, MAX_BACKOFF_S)
    await supervisor.run(name, body, lambda: None)
