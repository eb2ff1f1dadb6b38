"""What the router's two ZMQ readers (KV events, load feed) share: per-worker subscriptions.

A registry holds one subscription per worker URL, the reason each other worker has none (kept
for ``/list_workers`` and logged once per change).
A subscription is anything with ``cancel()``, ``async close()`` and ``describe()``.

What a worker sends is not trusted (it may be hostile or broken), so both readers also share:
``zmtp.py`` (every connection dialled to a worker is read by the router's own ZMTP client,
which bounds each message's frames and bytes and the messages held; libzmq's ``MAXMSGSIZE``
bounds only frames, so a message of endless small frames would pass it); from ``control``
they take ``WarningLimiter`` (a warning per bad message would let a
worker flood the log) and ``Supervisor`` (a reader that fails is logged with its traceback,
counted, reported and restarted with backoff; it never dies silently).
"""

from __future__ import annotations

import logging
from typing import Any, Generic, Protocol, TypeVar

log = logging.getLogger("omniinfer.proxy")


class Subscription(Protocol):
    def cancel(self) -> None: ...

    async def close(self) -> None: ...

    def describe(self) -> dict[str, Any]: ...


S = TypeVar("S", bound=Subscription)


class WorkerSubscriptions(Generic[S]):
    """Subscriptions by worker URL, and why the others have none."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self._subs: dict[str, S] = {}
        self._fallback: dict[str, str] = {}

    def __contains__(self, url: str) -> bool:
        return url in self._subs

    def get(self, url: str) -> S | None:
        return self._subs.get(url)

    def add(self, url: str, sub: S) -> None:
        self._fallback.pop(url, None)
        self._subs[url] = sub

    def refuse(self, url: str, reason: str, message: str, level: int = logging.WARNING) -> None:
        """``url`` gets no subscription because of ``reason``; ``message`` % (url, reason) is
        logged when the reason is new for it."""
        if self._fallback.get(url) != reason:
            log.log(level, message, url, reason)
        self._fallback[url] = reason

    def detach(self, url: str) -> None:
        """Stop following ``url`` now: its tasks apply nothing more (they close on their own)."""
        self._fallback.pop(url, None)
        sub = self._subs.pop(url, None)
        if sub is not None:
            sub.cancel()

    async def close(self) -> None:
        for url in list(self._subs):
            await self._subs.pop(url).close()

    def describe_workers(self, key: str, fallback: str) -> dict[str, Any]:
        """Each subscription's description, and ``{key: fallback, "reason": ...}`` for the rest."""
        workers: dict[str, Any] = {url: sub.describe() for url, sub in self._subs.items()}
        for url, reason in self._fallback.items():
            workers[url] = {key: fallback, "reason": reason}
        return {"mode": self.mode, "workers": workers}

