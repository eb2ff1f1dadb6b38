"""One client request through the router: what is routed, its phase clock, its access-log line.

``Request`` is the only per-request object the request flow passes around. It holds the body as
the client sent it, the policy view (``RouteRequest``, what policies see), the router's rids of
the current attempt, the ``Lifecycle`` (phase clock, read by /metrics) and, as typed fields, what
the access log gets; ``access_record`` writes the access-log line from them.

The eight request phases of the paper, each timestamped, as the router can observe them; each
starts at the event named here, marked by ``forward.py`` before routing, then by ``attempt.py``
(``route``; ``Attempt.report``, from the strategy's event in brackets, ``strategy.Event``):
  tokenize           arrival (body read, then tokenized)                         [forward]
  apc_matching       prompt tokenized; prefix blocks hashed and matched           [forward]
  prefill_waiting    the request goes to admission and the (prefill) policy       [route]
  prefill_scheduled  the attempt's first post went out                            [POSTED]
  prefill_running    the (prefill) worker's response head                         [HEAD]
  decode_waiting     PD: the prefill worker's answer completed: prefill done; the
                     decode worker waits for the KV and a decode slot             [ANSWER]
  decode_scheduled   PD: the decode worker's first output reached the router (a
                     stream's first event; a non-streamed answer's head)          [OUTPUT]
  decode_running     first output token sent to the client (``token``: a stream's
                     first event, which also times TTFT); PD non-streamed: the
                     decode answer read whole, before it goes to the client
                                                               [FIRST_TOKEN; decode ANSWER]
Regular mode goes through ``REGULAR_PHASES`` (no decode_waiting/decode_scheduled; a
non-streamed answer shows no first token, so its prefill_running lasts to the end), PD through
all eight. Phases are entered in order; a phase entered after a later one is ignored (in PD the
two workers' events race: a prefill answer that comes after the decode's first output adds
nothing). A phase entered implies the earlier phases of the mode: any not yet entered is entered
at the same instant, with no duration (the decode's first output means the prefill was done;
the decode's response head, which SGLang sends before its first event, is no such event). A phase
never entered (a failed or refused request) has no duration.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from typing import Any

import orjson

from omniinfer.proxy.policy_api import RouteRequest


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
PD_PHASES: tuple[Phase, ...] = tuple(Phase)
REGULAR_PHASES: tuple[Phase, ...] = tuple(
    p for p in Phase if p not in (Phase.DECODE_WAITING, Phase.DECODE_SCHEDULED))
_NO_MARKS: tuple[None, ...] = (None,) * len(Phase)  # len(Phase) is a Python-level call


class Lifecycle:
    """Monotonic enter times of each phase plus first-token and finish times.

    ``phases``: the phases of the request's mode (``PD_PHASES`` until the mode's strategy sets
    it); entering one enters the mode's earlier phases not yet entered at the same instant."""

    __slots__ = ("request_id", "arrival", "arrival_wall", "marks", "last", "first_token",
                 "finished", "output_tokens", "phases")

    def __init__(self, request_id: str, now: float | None = None) -> None:
        self.request_id = request_id
        self.arrival = time.perf_counter() if now is None else now
        self.arrival_wall = time.time()
        self.marks: list[float | None] = list(_NO_MARKS)
        self.last = -1
        self.first_token: float | None = None
        self.finished: float | None = None
        self.output_tokens = 0
        self.phases = PD_PHASES

    def enter(self, phase: Phase, now: float | None = None) -> bool:
        """Mark ``phase`` entered at ``now`` (never before the phase entered last); the mode's
        phases between the last one entered and ``phase`` are entered at the same time. False
        (and no change) if ``phase`` or a later phase was entered already."""
        last = self.last
        if phase <= last:
            return False
        marks = self.marks
        t = time.perf_counter() if now is None else now
        before = marks[last] if last >= 0 else None
        if before is not None and before > t:
            t = before
        if phase > last + 1:
            for implied in self.phases:
                if last < implied < phase:
                    marks[implied] = t
        marks[phase] = t
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


class Request:
    """One client request from arrival to its access-log line.

    Made at arrival (id, endpoint, clock started); ``prepare`` adds what parsing found (body,
    prompt count, policy view, client rid); ``route``, ``body`` are read only after it. The
    attempt loop and the upstream I/O fill the log fields through the methods below; ``finish``
    stops the clock with the answer's status. Fields left unset stay out of the access log.
    """

    __slots__ = ("id", "endpoint", "life", "prepared", "body", "stream", "batch", "route",
                 "headers", "rids", "output_events", "tail", "client_rid", "status", "decisions",
                 "bootstrap_room", "worker_rids", "failures", "error", "output_tokens",
                 "reported_cached_tokens", "cache_prediction", "delivered", "request_id",
                 "trace_lines", "begun")

    body: dict[str, Any]  # as the client sent it (never the router's rids)
    route: RouteRequest  # what the policies see

    def __init__(self, request_id: str, endpoint: str) -> None:
        self.id = request_id
        self.request_id = request_id  # the client's (--request-id-headers), else the router's
        self.trace_lines = b""  # traceparent header lines for the workers (--enable-trace)
        self.begun = False  # a stream's head is being or was written: no other answer now
        self.endpoint = endpoint
        self.life = Lifecycle(request_id)
        self.prepared = False
        self.stream = False
        self.batch = 1  # prompts in the request
        self.headers: dict[str, str] = {}  # added to the client's answer
        self.rids: list[str] = []  # the router's rids of the current attempt
        self.output_events = 0  # ``data:`` events of a stream so far
        self.tail = b""  # a stream's last bytes (its final usage)
        self.delivered = False  # the client was sent the stream's closing [DONE] event
        # the access-log record (None / empty: not written)
        self.client_rid: Any = None
        self.status = 500
        self.decisions: list[dict[str, Any]] = []
        self.bootstrap_room: Any = None
        self.worker_rids: list[Any] = []
        self.failures: list[str] = []
        self.error: str | None = None
        self.output_tokens: int | None = None
        self.reported_cached_tokens: int | None = None
        self.cache_prediction: str | None = None

    def prepare(self, body: dict[str, Any], batch: int, route: RouteRequest) -> None:
        """The parsed request: its body, the number of prompts in it and its policy view."""
        self.body = body
        self.stream = body.get("stream", False)
        self.batch = batch
        self.route = route
        self.client_rid = body.get("rid")
        self.prepared = True

    def attempted(self, rids: list[str], fields: dict[str, Any] | None) -> None:
        """An attempt begins with ``rids`` and the body ``fields`` its strategy added: the rids
        become the current attempt's; they and PD's ``bootstrap_room`` go to the access log."""
        self.rids = rids
        self.worker_rids.append(rids[0] if self.batch == 1 else rids)
        if fields and "bootstrap_room" in fields:
            self.bootstrap_room = fields["bootstrap_room"]

    def payloads(self, rids: list[str], extra: dict[str, Any] | None,
                 per_worker: Sequence[dict[str, Any]]) -> list[bytes]:
        """The workers' bodies of one attempt, one per entry of ``per_worker`` (fields only that
        worker gets: its DP rank): the client's body with the router's rid(s) (never the
        client's), plus ``extra``. Changes nothing."""
        rid: Any = rids[0] if self.batch == 1 else rids
        body = dict(self.body)
        body["rid"] = rid
        if extra:
            body.update(extra)
        shared = b""
        out = []
        for own in per_worker:
            if own:
                out.append(orjson.dumps({**body, **own}))
                continue
            shared = shared or orjson.dumps(body)
            out.append(shared)
        return out

    def decided(self, role: str, worker: str, reason: str, policy: str, attempt: int,
                cached_tokens: int, dp_rank: int | None = None) -> None:
        record = {"role": role, "worker": worker, "reason": reason, "policy": policy,
                  "attempt": attempt, "cached_tokens": cached_tokens}
        if dp_rank is not None:
            record["dp_rank"] = dp_rank
        self.decisions.append(record)

    def failed(self, worker: str, failure: Exception) -> None:
        """An attempt failed on ``worker`` (its URL and text stay in the log only)."""
        self.failures.append(f"{worker}: {failure}")

    def counted(self, output_tokens: int) -> None:
        """The answer's output tokens (for tpot and the log)."""
        self.life.output_tokens = output_tokens
        self.output_tokens = output_tokens

    def predicted(self, reported: int | None, outcome: str) -> None:
        """The worker's reported cached tokens and how the router's prediction compared."""
        if reported is not None:
            self.reported_cached_tokens = reported
        self.cache_prediction = outcome

    def finish(self, status: int) -> None:
        self.status = status
        self.life.finish()

    def access_record(self) -> dict[str, Any]:
        """The access-log line: what is known of the request, its phases and latencies."""
        record: dict[str, Any] = {"id": self.id, "endpoint": self.endpoint}
        if self.request_id != self.id:
            record["request_id"] = self.request_id
        if self.prepared:
            record["stream"] = self.stream
            record["prompt_tokens"] = self.route.prompt_tokens
            record["batch"] = self.batch
            if self.client_rid is not None:
                record["client_rid"] = self.client_rid
        if self.decisions:
            record["decisions"] = self.decisions
        if self.bootstrap_room is not None:
            record["bootstrap_room"] = self.bootstrap_room
        if self.worker_rids:
            record["worker_rids"] = self.worker_rids
        if self.failures:
            record["failures"] = self.failures
        if self.error is not None:
            record["error"] = self.error
        if self.output_tokens is not None:
            record["output_tokens"] = self.output_tokens
        if self.reported_cached_tokens is not None:
            record["reported_cached_tokens"] = self.reported_cached_tokens
        if self.cache_prediction is not None:
            record["cache_prediction"] = self.cache_prediction
        life = self.life
        record["status"] = self.status
        record["arrival"] = round(life.arrival_wall, 6)
        record["phases"] = life.timestamps()
        record["durations"] = {k: round(v, 6) for k, v in life.durations().items()}
        record["ttft"], record["e2e"], record["tpot"] = life.ttft(), life.e2e(), life.tpot()
        return record
