"""``--dp-aware``: every request goes to one data-parallel rank of its worker, named in its body.

A SGLang worker started with ``--dp-size N`` serves its N ranks behind one HTTP port; a request
whose body carries ``routed_dp_rank`` goes to that rank (SGLang 0.5.23's
``DataParallelController.maybe_external_dp_rank_routing``; ``data_parallel_rank`` is its
deprecated alias), otherwise the worker balances by itself (``--load-balance-method``). In PD the
decode rank that receives the KV must know which prefill rank holds it:
``disagg_prefill_dp_rank`` (without it the decode asks the prefill's bootstrap server, or
assumes ``bootstrap_room % dp_size``).

Contracts:

- A worker's rank count is its ``/server_info`` ``dp_size`` (1..``MAX_DP_RANKS``), read when
  the router meets the worker (start, ``POST /add_worker``, re-admission). An answer without a
  usable ``dp_size`` changes nothing: a worker met for the first time keeps one rank (the router
  names no rank for it and it balances by itself), a re-admitted one the count it had; a
  warning names the reason.
- A policy may name the rank itself (OAS's decode LPT places over ranks); otherwise the rank is
  the least loaded: the larger of the router's own in-flight tokens there and the rank's own
  report (KV tokens held for a decode rank; queued uncached prompt tokens for a prefill or
  regular one), then fewest requests sent there, then the lowest rank.
- The fields each worker of an attempt gets: regular ``routed_dp_rank``; PD prefill
  ``routed_dp_rank`` and ``disagg_prefill_dp_rank`` (both its own rank, so a prefill that
  follows the bootstrap room sees no conflict); PD decode ``routed_dp_rank`` (its own, when it
  is DP) and ``disagg_prefill_dp_rank`` (the prefill's, when that one is DP). A worker with one
  rank gets none of them: the body is then byte for byte what it was without ``--dp-aware``.
"""

from __future__ import annotations

import logging
import reprlib
from collections.abc import Sequence
from typing import Any

from omniinfer.proxy.policy_api import Decision
from omniinfer.proxy.workers import MAX_DP_RANKS, Role, Worker

log = logging.getLogger("omniinfer.proxy")
ROUTED_RANK = "routed_dp_rank"  # SGLang 0.5.23 GenerateReqInput fields
PREFILL_RANK = "disagg_prefill_dp_rank"


def dp_size_from(info: Any) -> int:
    """The rank count a ``/server_info`` answer states, or ValueError naming why not."""
    size = info.get("dp_size") if isinstance(info, dict) else None
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_DP_RANKS:
        raise ValueError(f"dp_size {reprlib.repr(size)} is not an int within 1..{MAX_DP_RANKS}")
    return size


def learn_dp_size(worker: Worker, info: Any) -> None:
    """Set ``worker``'s rank count from its ``/server_info`` answer. An answer that does not
    say (a timeout under load, a bad value) leaves a known count as it is, and a worker met for
    the first time with one rank; a warning names the reason."""
    try:
        size = dp_size_from(info)
    except ValueError as exc:
        log.warning("--dp-aware: %s: %s; %s", worker.url, exc,
                    f"keeping its {worker.dp_size} ranks" if worker.dp_size > 1
                    else "its requests name no rank")
        return
    if size != worker.dp_size:
        log.info("--dp-aware: %s has %d data-parallel rank(s)", worker.url, size)
    worker.set_dp_size(size)


def rank_load(worker: Worker, rank: int) -> int:
    """Tokens of work at ``rank`` (see the module's contract)."""
    reported = worker.loads.rank(rank)
    own = reported.used_tokens if worker.role is Role.DECODE else reported.waiting_uncached_tokens
    return max(worker.rank_inflight_tokens[rank], own)


def least_loaded_rank(worker: Worker) -> int:
    return min(range(worker.dp_size),
               key=lambda r: (rank_load(worker, r), worker.rank_requests[r], r))


def assign_ranks(decisions: Sequence[Decision]) -> None:
    """Name a rank in every decision for a worker with several ranks that has none yet."""
    for decision in decisions:
        if decision.rank is None and decision.worker.dp_size > 1:
            decision.rank = least_loaded_rank(decision.worker)


def rank_fields(decisions: Sequence[Decision]) -> list[dict[str, int]]:
    """The body fields each decided worker gets, in the decisions' order (see the module)."""
    prefill_rank = next((d.rank for d in decisions if d.worker.role is Role.PREFILL), None)
    fields: list[dict[str, int]] = []
    for decision in decisions:
        own: dict[str, int] = {}
        if decision.rank is not None:
            own[ROUTED_RANK] = decision.rank
        if prefill_rank is not None and decision.worker.role in (Role.PREFILL, Role.DECODE):
            own[PREFILL_RANK] = prefill_rank
        fields.append(own)
    return fields
