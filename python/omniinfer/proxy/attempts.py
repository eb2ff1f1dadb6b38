"""What every attempt of a request records and how a failed one waits, in both modes.

Regular forwarding (``forward.py``) and the PD pairing (``pd.py``) share these: the decision
recorded (metrics and access log), the backoff before a retry, the answer when no attempt
succeeded (no worker URL, no worker text: both stay in the log), and the cache prediction
checked against what the worker reported.
"""

from __future__ import annotations

import asyncio
import logging
import random

from aiohttp import web

from omniinfer.proxy.auth import error_response
from omniinfer.proxy.base import Decision
from omniinfer.proxy.core import Router
from omniinfer.proxy.upstream import Exchange, UpstreamFailure
from omniinfer.proxy.workers import Role, Worker

log = logging.getLogger("omniinfer.proxy")


def decided(router: Router, role: Role, ex: Exchange, decision: Decision, attempt: int) -> None:
    policy = router.policies[role]
    router.metrics.decision(policy.name, role.value, decision.reason)
    ex.record.setdefault("decisions", []).append(
        {"role": role.value, "worker": decision.worker.url, "reason": decision.reason,
         "policy": policy.name, "attempt": attempt,
         "cached_tokens": ex.route.cached_tokens(decision.worker)})


async def backoff(router: Router, attempt: int) -> None:
    c = router.config
    delay = min(c.retry_max_backoff_ms, c.retry_initial_backoff_ms
                * c.retry_backoff_multiplier ** attempt) / 1000.0
    delay *= 1.0 + c.retry_jitter_factor * (2 * random.random() - 1)
    await asyncio.sleep(max(0.0, delay))


def no_worker(failure: UpstreamFailure | None) -> web.Response:
    """The answer when no attempt succeeded; the worker's URL and text stay in the log."""
    if failure is None:
        return error_response(503, "no healthy worker available", "unavailable", retry_after=1)
    log.warning("request failed: %s: %s", failure.worker.url, failure)
    return error_response(502, f"the upstream worker failed ({failure.summary})",
                          "upstream_error")


def note_prediction(router: Router, ex: Exchange, worker: Worker, reported: int | None) -> None:
    """Predicted vs reported cached tokens of the worker that served a single prompt."""
    if ex.batch != 1:
        return  # the prediction is for the first prompt of a batch only
    predicted = ex.route.cached_tokens(worker)
    if reported is not None:
        ex.record["reported_cached_tokens"] = reported
    ex.record["cache_prediction"] = router.metrics.observe_prediction(
        router.cache_truth.label(worker), predicted, reported, ex.route.block_size)
