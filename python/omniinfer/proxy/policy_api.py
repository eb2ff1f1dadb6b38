"""Routing policy interface and registry, one policy per file.

A policy sees a ``RouteRequest`` (token counts and the APC match per worker, computed by the
router before routing) and the workers of one role that may take it now (healthy, circuit
closed, not yet tried for this request: the pool's ``candidates``); ``pick`` returns a
``Decision`` with a reason (counted in /metrics and written to the access log). Policies that
hold requests back (deferred submission) override the async ``schedule``; those that learn from
timing use the hooks. Adding a policy is adding one module to ``omniinfer.proxy.policies`` that
calls ``register_policy``.
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
import pkgutil
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar

from omniinfer.proxy.config import RouterConfig
from omniinfer.proxy.prefix import PrefixIndex
from omniinfer.proxy.workers import Role, Worker


@dataclasses.dataclass(slots=True)
class RouteRequest:
    """What a policy may know about a request (all sizes in tokens)."""

    request_id: str
    prompt_tokens: int
    output_tokens: int
    block_hashes: Sequence[int] = ()
    block_size: int = 16
    matched_blocks: dict[str, int] = dataclasses.field(default_factory=dict)  # by worker URL
    arrival: float = 0.0
    endpoint: str = "generate"

    def cached_tokens(self, worker: Worker) -> int:
        """Prompt tokens the worker can reuse; SGLang always recomputes the last one."""
        matched = self.matched_blocks.get(worker.url, 0) * self.block_size
        return max(0, min(self.prompt_tokens - 1, matched))

    def uncached_tokens(self, worker: Worker) -> int:
        return self.prompt_tokens - self.cached_tokens(worker)


@dataclasses.dataclass(slots=True)
class Decision:
    """The worker a policy chose and why (the reason is a metric label: a few fixed words), and,
    for a worker with several data-parallel ranks under ``--dp-aware``, the rank (``dp.py``)."""

    worker: Worker
    reason: str
    rank: int | None = None


@dataclasses.dataclass
class PolicyContext:
    """Router state shared with policies (read-only for them)."""

    config: RouterConfig
    prefix_index: PrefixIndex
    role: Role
    mean_request_tokens: float = 512.0

    def observe_request_tokens(self, tokens: int, weight: float = 0.05) -> None:
        """Running mean of a request's token cost (turns request-count knobs into tokens)."""
        self.mean_request_tokens += weight * (tokens - self.mean_request_tokens)


def least_loaded(workers: Sequence[Worker]) -> Worker:
    """Fewest in-flight tokens, then fewest in-flight requests, then list order."""
    return min(workers, key=lambda w: (w.load_tokens(), w.inflight_requests))


class PolicyHooks:
    """Optional hooks; the router calls them on the policy of the worker's role.

    For one request and worker, ``on_dispatch`` is followed by exactly one ``on_complete``; a
    decision never dispatched gets ``on_cancelled`` instead (all called from ``attempt.py``).
    """

    def on_dispatch(self, request: RouteRequest, worker: Worker) -> None:
        """The request was sent to ``worker``."""

    def on_prefill_done(self, request: RouteRequest, worker: Worker, seconds: float) -> None:
        """The worker finished this request's prefill ``seconds`` after dispatch."""

    def on_complete(self, request: RouteRequest, worker: Worker, ok: bool) -> None:
        """The worker is done with the request (ok False: it failed or was aborted)."""

    def on_cancelled(self, request: RouteRequest, worker: Worker) -> None:
        """The decision for ``worker`` was made but nothing was sent (give back any booking)."""
        self.on_complete(request, worker, False)

    def on_loads(self, worker: Worker) -> None:
        """``worker.loads`` was refreshed from the worker's /v1/loads."""

    def on_workers_changed(self, workers: Sequence[Worker]) -> None:
        """A worker was added or removed."""


class Policy(PolicyHooks, abc.ABC):
    name: ClassVar[str] = "base"
    uses_prefix: ClassVar[bool] = False  # the router matches the decode index only if True

    def __init__(self, context: PolicyContext) -> None:
        self.context = context

    @abc.abstractmethod
    def pick(self, request: RouteRequest, workers: list[Worker]) -> Decision:
        """Choose among ``workers`` (non-empty) at once."""

    async def schedule(self, request: RouteRequest, workers: list[Worker]) -> Decision | None:
        """Pick at once; None if no worker can take it. Deferring policies override this."""
        return self.pick(request, workers) if workers else None

    def describe(self) -> dict[str, Any] | None:
        """The policy's state for /list_workers (``policy_state``); None: nothing to show."""
        return None


_REGISTRY: dict[str, type[Policy]] = {}
P = TypeVar("P", bound=type[Policy])


def register_policy(name: str) -> Callable[[P], P]:
    def wrap(cls: P) -> P:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"policy {name!r} registered twice")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return wrap


BUILTIN_POLICY_PACKAGES = ("omniinfer.proxy.policies", "omniinfer.proxy.oas")


def _load_builtin_policies() -> None:
    """Import every module of the built-in policy packages (each registers what it defines)."""
    for name in BUILTIN_POLICY_PACKAGES:
        package = importlib.import_module(name)
        for info in pkgutil.iter_modules(package.__path__):
            if not info.name.startswith("_"):
                importlib.import_module(f"{package.__name__}.{info.name}")


def available_policies() -> list[str]:
    _load_builtin_policies()
    return sorted(_REGISTRY)


def create_policy(name: str, context: PolicyContext) -> Policy:
    _load_builtin_policies()
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(sorted(_REGISTRY))}") from None
    return cls(context)
