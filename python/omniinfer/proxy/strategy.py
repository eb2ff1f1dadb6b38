"""The contract between the attempt loop (``attempt.py``) and a mode (``regular.py``, ``pd.py``).

A mode says what to send and reports what its workers did; the attempt loop does everything
else: decisions, bookings, rids, phase marks, breaker results, aborts, the policies' hooks, the
cache-prediction check. The two sides cross only here:

  attempt → strategy  ``Strategy.view``, ``Strategy.cost``, ``Strategy.fields``, ``Strategy.send``
  strategy → attempt  what ``send`` is given, an ``Outbox``: the decided workers, their bodies,
                      ``background`` (a worker's request that may outlive the answer) and
                      ``report`` (one ``Event`` of a worker)

A strategy never marks a phase, records a breaker result, aborts a worker or calls a policy;
``Attempt.report`` says what each event does (the table in ``attempt.py``). Its failures it raises:
``UpstreamFailure`` (nothing reached the client) or ``Passthrough`` (a worker refused).
"""

from __future__ import annotations

import abc
import asyncio
import enum
from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, Any

from aiohttp import web

from omniinfer.proxy.policy_api import RouteRequest
from omniinfer.proxy.request import PD_PHASES, Phase, Request
from omniinfer.proxy.workers import Role, Worker

if TYPE_CHECKING:
    from omniinfer.proxy.core import Router

HeldTask = asyncio.Task[tuple[int, bytes]]  # a worker's whole answer: (status, body)


class Event(enum.Enum):
    """What a worker did, as a strategy reports it (``Outbox.report``); ``detail`` in brackets.

    POSTED        the attempt's first post goes out now (reported with the first worker)
    HEAD          the (prefill) worker's response head arrived (not the decode's: SGLang sends
                  it at once, while the prefill runs)
    OUTPUT        the worker's first output reached the router: a stream's first event, a
                  non-streamed decode answer's head
    ANSWER        the worker's answer was read whole, status 200
    CACHED        the worker reported the prompt tokens it had cached [int, or None: none said]
    FIRST_TOKEN   the stream's first event went to the client
    STREAM_END    the worker ended the stream to the client
    STREAM_FAILED the worker failed mid-stream [(failure kind, exception class name)]
    STREAM_CUT    the router's shutdown cut the stream to the client
    """

    POSTED = "posted"
    HEAD = "head"
    OUTPUT = "output"
    ANSWER = "answer"
    CACHED = "cached"
    FIRST_TOKEN = "first_token"
    STREAM_END = "stream_end"
    STREAM_FAILED = "stream_failed"
    STREAM_CUT = "stream_cut"


class Outbox(abc.ABC):
    """What a strategy's ``send`` may use of its attempt (``attempt.Attempt`` implements it).

    ``workers``: the decided workers in the strategy's role order. ``router``, ``client`` and
    ``request`` are for the I/O only (posting, the client's answer, the fields it fills)."""

    __slots__ = ()
    router: Router
    client: web.Request
    request: Request

    @property
    @abc.abstractmethod
    def workers(self) -> Sequence[Worker]: ...

    @abc.abstractmethod
    def payload(self, worker: Worker) -> bytes:
        """The body ``worker`` gets in this attempt."""

    @abc.abstractmethod
    def background(self, worker: Worker,
                   request: Coroutine[Any, Any, tuple[int, bytes]]) -> HeldTask:
        """Run ``worker``'s request as a task that may outlive the answer; ``worker``'s booking
        lasts until it ends (a failed or left attempt cancels it). Its (status, body) is the
        worker's answer; an ``UpstreamFailure`` it raises counts against the worker."""

    @abc.abstractmethod
    def report(self, event: Event, worker: Worker, detail: Any = None) -> None:
        """``worker`` did ``event`` (see ``Event`` for each one's ``detail``)."""


class Strategy(abc.ABC):
    """What one mode supplies to the attempt loop; one instance per request.

    ``roles``: the roles decided per attempt, in order (one decision and one booking each).
    ``phases``: the lifecycle phases of the mode (``request.py``), set on the request's clock.
    ``view(role)``: the policy view ``role``'s policy decides on, asked when that role's turn
    comes (after the earlier roles were decided). ``cost(worker)``: the tokens booked on a
    decided worker. ``fields(workers)``: fields added to every decided worker's body of one
    attempt (None: none). ``send(out)`` posts the attempt and answers the client, reporting its
    workers' events; it raises ``UpstreamFailure`` or ``Passthrough``.
    """

    roles: tuple[Role, ...] = ()
    phases: tuple[Phase, ...] = PD_PHASES

    def __init__(self, router: Router, client: web.Request, request: Request) -> None:
        self.router, self.client, self.request = router, client, request
        request.life.phases = self.phases

    @abc.abstractmethod
    def view(self, role: Role) -> RouteRequest: ...

    @abc.abstractmethod
    def cost(self, worker: Worker) -> int: ...

    def fields(self, workers: Sequence[Worker]) -> dict[str, Any] | None:
        return None

    @abc.abstractmethod
    async def send(self, out: Outbox) -> web.StreamResponse: ...
