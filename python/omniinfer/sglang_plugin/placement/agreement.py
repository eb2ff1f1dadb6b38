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
the same version. The vote happens only at the target pass of a posted layout; passes without
a pending switch cost one uncontended lock.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Due(Generic[T]):
    """A posted layout whose target pass just ended: switch it iff ``agreed``."""

    version: int
    target_pass: int
    payload: T
    agreed: bool


class SwitchAgreement(Generic[T]):
    """The pass counter of one rank and the vote that makes a switch collective.

    Contract: :meth:`pass_end` is called by the main thread once per forward pass, on every
    rank, and when it returns a :class:`Due` the caller switches iff ``agreed`` and then calls
    :meth:`settle`; :meth:`propose` is called by one other thread, with the same versions and
    targets on every rank, and never while another collective of that thread is in flight on
    ``group``. ``group`` is a gloo process group over every rank.
    """

    def __init__(self, group: Any) -> None:
        self.group = group
        self.passes = 0
        self._lock = threading.Lock()
        self._pending: tuple[int, int, T] | None = None  # (version, target pass, payload)
        self._settled = threading.Event()
        self._switched = False

    # ------------------------------------------------------------------ main thread

    def pass_end(self) -> Due[T] | None:
        """Count one forward pass; at the target pass of a posted layout, vote (blocks until
        every rank voted) and return what to do. None on every other pass."""
        with self._lock:
            self.passes += 1
            pending = self._pending
            if pending is None or pending[1] != self.passes:
                return None
            self._pending = None
        version, target, payload = pending
        return Due(version, target, payload, self._vote(version, ready=True))

    def settle(self, switched: bool) -> None:
        """After a :class:`Due`: tell the proposing thread whether this rank switched."""
        self._switched = switched
        self._settled.set()

    # ------------------------------------------------------------- proposing thread

    def propose(self, version: int, target_pass: int, payload: T) -> bool:
        """Post ``payload`` for the end of pass ``target_pass``; returns once every rank has
        voted on it: True iff it was switched in at that pass, on every rank."""
        with self._lock:
            in_time = self.passes < target_pass
            if in_time:
                self._settled.clear()
                self._pending = (version, target_pass, payload)
        if not in_time:  # the main thread went past the target: vote "not ready" from here
            self._vote(version, ready=False)
            return False
        self._settled.wait()
        return self._switched

    # -------------------------------------------------------------------- the vote

    def _vote(self, version: int, ready: bool) -> bool:
        ballot = torch.tensor([int(ready), version, -version], dtype=torch.int64)
        dist.all_reduce(ballot, op=dist.ReduceOp.MIN, group=self.group)
        all_ready, lowest, highest = int(ballot[0]), int(ballot[1]), -int(ballot[2])
        return all_ready == 1 and lowest == highest
