"""Interfaces of the worker emulator: the cost model, the prefix cache and small result types.

The engine (``engine.py``) asks a :class:`CostModel` how long each forward pass takes and a
:class:`BasePrefixCache` how many prompt tokens are already resident; a profile
(``profile.py``) supplies the numbers. Times are model seconds; the engine scales them by
``--time-scale`` when it sleeps.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import NamedTuple


class PrefillItem(NamedTuple):
    """One request's share of a prefill (extend) batch."""

    new_tokens: int  # tokens computed in this pass (a chunk of the uncached part)
    context_tokens: int  # tokens already in KV before this pass (cached prefix + earlier chunks)


class CostModel(abc.ABC):
    """How long the emulated accelerator takes for each kind of work, in model seconds."""

    @abc.abstractmethod
    def prefill_time(self, items: Sequence[PrefillItem], running: int = 0) -> float:
        """One prefill (extend) forward pass over ``items`` while ``running`` requests decode."""

    @abc.abstractmethod
    def decode_time(self, batch_size: int, kv_tokens: int) -> float:
        """One decode step of ``batch_size`` requests attending to ``kv_tokens`` in total."""

    @abc.abstractmethod
    def transfer_time(self, tokens: int) -> float:
        """Moving the KV of ``tokens`` tokens from a prefill to a decode instance."""


class MatchResult(NamedTuple):
    """A prefix-cache lookup: how many leading tokens are resident, and where the match ends."""

    length: int
    node: object  # opaque handle, passed back to lock/unlock


class CacheSize(NamedTuple):
    total: int  # tokens held by the cache
    evictable: int  # of which no running request holds a lock


class BasePrefixCache(abc.ABC):
    """A prefix cache over token ids (the radix cache of SGLang, in miniature)."""

    @abc.abstractmethod
    def match_prefix(self, ids: Sequence[int]) -> MatchResult: ...

    @abc.abstractmethod
    def insert(self, ids: Sequence[int]) -> int:
        """Insert ``ids``; returns how many tokens were newly added."""

    @abc.abstractmethod
    def lock(self, node: object) -> None:
        """Protect the path to ``node`` from eviction (a running request uses it)."""

    @abc.abstractmethod
    def unlock(self, node: object) -> None: ...

    @abc.abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Evict at least ``num_tokens`` unlocked tokens, least recently used first."""

    @abc.abstractmethod
    def size(self) -> CacheSize: ...

    @abc.abstractmethod
    def reset(self) -> None: ...
