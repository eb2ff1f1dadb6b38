"""Switching a staged layout in on the same forward pass on every rank, or on none.

The background thread of each rank stages a layout, the ranks agree on a target pass ``T``
(every rank's pass count, MAX-reduced, plus a delay), and the thread posts the layout here. A
thread starved of the GIL may post after its own forward loop already went past ``T``; switching
then, late, would let the ranks dispatch with different expert maps for some passes. So the
switch at ``T`` is itself agreed, by one vote of every rank at ``T``:

- a rank whose layout was posted in time votes from its main thread when pass ``T`` ends
  (ready), and switches only if the vote says every rank was ready;
- a rank whose layout was posted too late votes from its background thread, at once (not
  ready); the others are waiting for that vote at ``T``, so nobody has switched.

Exactly one vote per rank per attempt, decided under a lock against the pass counter: the post
is "in time" iff the main thread had not yet ended pass ``T``. The vote is one gloo all-reduce
(MIN) of three integers ``[ready, version, -version]``; the outcome depends only on the reduced
values, so every rank takes the same decision at the same pass: switch iff all were ready for
the same version. After an agreed vote every rank switches and then confirms it in a second
all-reduce (MAX of one flag per rank: "my switch failed"), so every rank learns, at the same
pass, whether every rank switched.

Failures never leave a rank on another collective sequence or another expert map while it keeps
serving; they are fatal, loudly (:class:`SwitchBroken`, raised from :meth:`pass_end` in the
forward loop, which makes SGLang's scheduler exit and its launcher stop the instance):

- a vote or confirmation that does not complete within ``timeout_s`` (a rank counting forward
  passes differently waits in the vote while the others wait for it in the model's collective;
  a rank died or hangs) or that raises: this rank cannot know what the others decided;
- an agreed switch that raised on any rank: the confirmation tells every rank, and every rank
  raises at that pass (there is nothing to roll back to: the live weights may be half written).

Once broken, the agreement issues no more collectives: :meth:`pass_end` raises at once and
:meth:`propose` raises instead of voting, so the proposing thread stops too. The vote happens
only at the target pass of a posted layout; passes without a pending switch cost one
uncontended lock.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")

logger = logging.getLogger("omniinfer")

VOTE_TIMEOUT_S = 120.0  # a vote that takes longer: a rank is not coming (read at construction)
WAIT_SLICE_S = 5.0  # the proposing thread re-checks (and reports) its wait this often


class SwitchBroken(RuntimeError):
    """The ranks can no longer be known to serve with one expert map: fatal for the scheduler."""


@dataclasses.dataclass(frozen=True)
class Due(Generic[T]):
    """A posted layout whose target pass just ended; ``agreed``: it was switched in, on every
    rank, at that pass."""

    version: int
    target_pass: int
    payload: T
    agreed: bool


class SwitchAgreement(Generic[T]):
    """The pass counter of one rank and the votes that make a switch collective.

    Contract: :meth:`pass_end` is called by the main thread once per forward pass, on every
    rank; :meth:`propose` is called by one other thread, with the same versions and targets on
    every rank, and never while another collective of that thread is in flight on ``group``.
    ``group`` is a gloo process group over every rank. Both raise :class:`SwitchBroken` once the
    ranks can no longer be known to agree (see the module docstring); after that neither issues
    a collective again.
    """

    def __init__(self, group: Any, timeout_s: float | None = None) -> None:
        self.group = group
        self.timeout_s = VOTE_TIMEOUT_S if timeout_s is None else float(timeout_s)
        self.passes = 0
        self._lock = threading.Lock()
        self._pending: tuple[int, int, T] | None = None  # (version, target pass, payload)
        self._settled = threading.Event()
        self._switched: bool | None = None  # None: broken
        self._broken: str | None = None  # why, once broken

    @property
    def broken(self) -> str | None:
        """Why the agreement broke (None while it holds)."""
        return self._broken

    # ------------------------------------------------------------------ main thread

    def pass_end(self, switch: Callable[[T], None]) -> Due[T] | None:
        """Count one forward pass; at the target pass of a posted layout, vote (bounded by
        ``timeout_s``), call ``switch(payload)`` iff every rank was ready, confirm it with every
        rank and return the outcome; None on every other pass. The proposing thread is always
        released, whatever happens here. Raises :class:`SwitchBroken` when a vote did not
        complete, when the switch failed on any rank, and on every pass after that."""
        if self._broken is not None:
            raise SwitchBroken(self._broken)
        with self._lock:
            self.passes += 1
            pending = self._pending
            if pending is None or pending[1] != self.passes:
                return None
            self._pending = None
        version, target, payload = pending
        outcome: bool | None = None  # unless set below, the proposing thread is told "broken"
        try:
            if not self._vote(version, ready=True, target=target):
                outcome = False
                return Due(version, target, payload, False)
            error = _attempt(switch, payload)
            if error is not None:
                logger.error("omniinfer: placement switch of layout version %d at pass %d failed "
                             "on this rank: %s: %s", version, target, type(error).__name__, error)
                logger.debug("omniinfer: placement switch failure", exc_info=error)
            failed = self._confirm(error is not None, version, target)
            if failed:
                raise self._break(
                    f"the switch of layout version {version} at pass {target} failed on rank(s) "
                    f"{failed} after every rank agreed to it") from error
            outcome = True
            return Due(version, target, payload, True)
        finally:
            self._settle(outcome)

    def _settle(self, switched: bool | None) -> None:
        self._switched = switched
        self._settled.set()

    # ------------------------------------------------------------- proposing thread

    def propose(self, version: int, target_pass: int, payload: T) -> bool:
        """Post ``payload`` for the end of pass ``target_pass``; returns once every rank has
        voted on it: True iff it was switched in at that pass, on every rank. Raises
        :class:`SwitchBroken` if the agreement is or becomes broken. Waits as long as the main
        thread takes to reach ``target_pass`` (no forward pass runs on an idle server; a long
        wait is logged); once the main thread took the layout, at most about ``timeout_s``."""
        with self._lock:
            if self._broken is not None:
                raise SwitchBroken(self._broken)
            in_time = self.passes < target_pass
            if in_time:
                self._settled.clear()
                self._pending = (version, target_pass, payload)
        if not in_time:  # the main thread went past the target: vote "not ready" from here
            self._vote(version, ready=False, target=target_pass)
            return False
        self._await_settled(version, target_pass)
        if self._switched is None:
            raise SwitchBroken(self._broken or "the switch pass ended without an outcome")
        return self._switched

    def _await_settled(self, version: int, target_pass: int) -> None:
        waited, reported = 0.0, False
        while not self._settled.wait(WAIT_SLICE_S):
            waited += WAIT_SLICE_S
            if waited >= self.timeout_s and not reported:
                reported = True
                logger.warning("omniinfer: placement switch of layout version %d waits for pass "
                               "%d; this rank is at pass %d after %.0f s (no forward passes?)",
                               version, target_pass, self.passes, waited)

    # -------------------------------------------------------------------- the votes

    def _vote(self, version: int, ready: bool, target: int) -> bool:
        ballot = torch.tensor([int(ready), version, -version], dtype=torch.int64)
        self._all_reduce(ballot, dist.ReduceOp.MIN, f"the switch vote at pass {target}")
        all_ready, lowest, highest = int(ballot[0]), int(ballot[1]), -int(ballot[2])
        return all_ready == 1 and lowest == highest

    def _confirm(self, failed_here: bool, version: int, target: int) -> list[int]:
        """Every rank, after an agreed switch: the ranks whose switch failed."""
        flags = torch.zeros(dist.get_world_size(self.group), dtype=torch.int64)
        flags[dist.get_rank(self.group)] = int(failed_here)
        self._all_reduce(flags, dist.ReduceOp.MAX,
                         f"the confirmation of layout version {version} at pass {target}")
        return [rank for rank, flag in enumerate(flags.tolist()) if flag]

    def _all_reduce(self, tensor: torch.Tensor, op: Any, what: str) -> None:
        """All-reduce in place, waiting at most ``timeout_s``; anything else breaks the agreement
        (the collective may still be in flight: this rank cannot know the outcome)."""
        try:
            work = dist.all_reduce(tensor, op=op, group=self.group, async_op=True)
            if work.wait(timeout=datetime.timedelta(seconds=self.timeout_s)) is False:
                raise TimeoutError("wait() returned False")
        except Exception as exc:
            raise self._break(
                f"{what} did not complete within {self.timeout_s:g} s ({type(exc).__name__}: "
                f"{exc}): a rank did not reach it (forward passes counted differently?), hangs "
                f"or died") from exc

    def _break(self, reason: str) -> SwitchBroken:
        if self._broken is None:
            self._broken = reason
            logger.critical("omniinfer: placement: %s; the ranks can no longer be known to serve "
                            "with one expert map: aborting this scheduler", reason)
        return SwitchBroken(self._broken)


def _attempt(switch: Callable[[T], None], payload: T) -> Exception | None:
    """Run ``switch(payload)``; the exception it raised, or None."""
    try:
        switch(payload)
    except Exception as exc:  # reported by the caller and confirmed with every rank
        return exc
    return None
