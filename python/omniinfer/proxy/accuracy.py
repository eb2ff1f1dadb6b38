"""Prediction accuracy: the router's predicted cached tokens against what the worker reused.

At routing time a policy sees ``RouteRequest.cached_tokens(worker)``, a prediction from the
prefix index. The worker's answer says what it really reused: ``meta_info.cached_tokens`` on
``/generate`` (every stream event carries it), ``usage.prompt_tokens_details.cached_tokens`` on
the OpenAI endpoints when the worker reports it. Comparing the two per request, labelled by what
filled the worker's index (``router`` or ``kv-events``), measures how true the index is.
The index knows whole blocks only, so a prediction is ``exact`` when it equals the report or the
report rounded down to whole blocks (a worker paging by 1 token reuses partial blocks too);
``over`` when it promised more, ``under`` when less. The token error is kept unrounded.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import orjson

OUTCOMES = ("exact", "over", "under")


def cached_tokens_in(obj: Any) -> int | None:
    """Cached tokens a decoded answer (or the first of a batch) reports; None if absent."""
    if isinstance(obj, list):
        obj = obj[0] if obj else None
    if not isinstance(obj, dict):
        return None
    meta = obj.get("meta_info")
    if isinstance(meta, dict) and isinstance(meta.get("cached_tokens"), int):
        return int(meta["cached_tokens"])
    usage = obj.get("usage")
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        return int(details["cached_tokens"])
    return None


def reported_cached_tokens(data: bytes) -> int | None:
    """Cached tokens in a JSON answer, or in the last SSE event that has them; None if absent."""
    if data.lstrip()[:1] in (b"{", b"["):
        try:
            return cached_tokens_in(orjson.loads(data))
        except orjson.JSONDecodeError:
            pass  # a stream's tail may also begin with a brace: read it as events
    for line in reversed(data.split(b"\n")):
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if not payload or payload == b"[DONE]":
            continue
        try:
            value = cached_tokens_in(orjson.loads(payload))
        except orjson.JSONDecodeError:
            continue  # the tail may begin inside an event
        if value is not None:
            return value
    return None


def reported_from_stream(first: bytes, tail: bytes) -> int | None:
    """A stream's cached tokens: from its end (OpenAI usage), else its first event."""
    value = reported_cached_tokens(tail)
    return value if value is not None else reported_cached_tokens(first)


def outcome(predicted: int, reported: int, block_size: int = 1) -> str:
    if predicted == reported or predicted == reported - reported % max(1, block_size):
        return "exact"
    return "over" if predicted > reported else "under"


@dataclasses.dataclass
class Tally:
    """Counts of one label (what filled the index of the chosen worker)."""

    exact: int = 0
    over: int = 0
    under: int = 0
    unreported: int = 0
    abs_error_tokens: int = 0
    predicted_tokens: int = 0
    reported_tokens: int = 0

    def add(self, predicted: int, reported: int | None, block_size: int = 1) -> str:
        if reported is None:
            self.unreported += 1
            return "unreported"
        result = outcome(predicted, reported, block_size)
        setattr(self, result, getattr(self, result) + 1)
        self.abs_error_tokens += abs(predicted - reported)
        self.predicted_tokens += predicted
        self.reported_tokens += reported
        return result

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = dataclasses.asdict(self)
        measured = self.exact + self.over + self.under
        out["measured"] = measured
        out["exact_share"] = round(self.exact / measured, 4) if measured else None
        out["mean_abs_error_tokens"] = (round(self.abs_error_tokens / measured, 2)
                                        if measured else None)
        return out
