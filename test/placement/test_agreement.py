""":class:`SwitchAgreement` alone, on one rank, with ``torch.distributed`` replaced by a fake
whose all-reduce stands for the other ranks: it can be told what they vote, to raise, or to
never complete (the bounded wait then times out, as gloo's ``Work.wait(timeout)`` does)."""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist

from omniinfer.sglang_plugin.placement import agreement
from omniinfer.sglang_plugin.placement.agreement import SwitchAgreement, SwitchBroken

JOIN_S = 5.0  # a proposing thread still waiting after this is stuck


class _Work:
    def __init__(self, completes: bool) -> None:
        self.completes = completes

    def wait(self, timeout: Any = None) -> bool:
        if not self.completes:
            raise RuntimeError("Operation timed out!")
        return True


class FakeDist:
    """The collectives of one rank of two; ``others`` is what the other rank contributes to
    each all-reduce in turn ("hang": it never comes, "raise": the call itself fails)."""

    ReduceOp = dist.ReduceOp

    def __init__(self, others: list[Any]) -> None:
        self.others = list(others)
        self.calls: list[tuple[list[int], threading.Thread]] = []

    def get_world_size(self, group: Any = None) -> int:
        return 2

    def get_rank(self, group: Any = None) -> int:
        return 0

    def all_reduce(self, tensor: torch.Tensor, op: Any = None, group: Any = None,
                   async_op: bool = False) -> Any:
        self.calls.append((tensor.tolist(), threading.current_thread()))
        other = self.others.pop(0)
        if other == "raise":
            raise RuntimeError("Connection closed by peer")
        if other == "hang":
            return _Work(completes=False)
        reduce = torch.minimum if op == dist.ReduceOp.MIN else torch.maximum
        tensor.copy_(reduce(tensor, torch.tensor(other, dtype=tensor.dtype)))
        return _Work(completes=True) if async_op else None


def _proposing(agree: SwitchAgreement[str], version: int, target: int) -> dict[str, Any]:
    """Start ``propose`` in a thread; the dict gets its result or exception."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = agree.propose(version, target, "layout")
        except Exception as exc:
            out["error"] = exc

    out["thread"] = threading.Thread(target=run, daemon=True)
    out["thread"].start()
    return out


def _until_posted(agree: SwitchAgreement[str]) -> None:
    for _ in range(500):
        if agree._pending is not None:
            return
        threading.Event().wait(0.01)
    raise AssertionError("the layout was never posted")


def _drive(agree: SwitchAgreement[str], switch: Any, passes: int) -> list[Any]:
    """End ``passes`` forward passes; what each returned or raised."""
    seen: list[Any] = []
    for _ in range(passes):
        try:
            seen.append(agree.pass_end(switch))
        except SwitchBroken as exc:
            seen.append(exc)
    return seen


def _agreement(monkeypatch: pytest.MonkeyPatch, others: list[Any],
               timeout_s: float) -> tuple[FakeDist, SwitchAgreement[str]]:
    """This rank's agreement over a ``FakeDist`` whose other rank contributes ``others``."""
    fake = FakeDist(others=others)
    monkeypatch.setattr(agreement, "dist", fake)
    return fake, SwitchAgreement(group=None, timeout_s=timeout_s)


@dataclasses.dataclass
class _Round:
    fake: FakeDist
    agree: SwitchAgreement[str]
    proposal: dict[str, Any]  # joined: its "result" or "error"
    seen: list[Any]  # what each pass returned or raised
    switched: list[str]  # the payloads the recording switch was given


def _round(monkeypatch: pytest.MonkeyPatch, others: list[Any], version: int, target: int,
           passes: int, timeout_s: float = 1.0, switch: Any = None) -> _Round:
    """``propose(version, target)`` in a thread, once posted ``passes`` forward passes (their
    switch: ``switch``, else one recording its payloads), then the proposer joined."""
    fake, agree = _agreement(monkeypatch, others, timeout_s)
    switched: list[str] = []
    proposal = _proposing(agree, version, target)
    _until_posted(agree)
    seen = _drive(agree, switch or switched.append, passes)
    proposal["thread"].join(JOIN_S)
    return _Round(fake, agree, proposal, seen, switched)


def test_an_agreed_switch_is_confirmed_and_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    # the other rank: ready for 7, switched fine
    run = _round(monkeypatch, [[1, 7, -7], [0, 0]], 7, 2, passes=3)
    assert run.proposal == {"thread": run.proposal["thread"], "result": True}
    seen = run.seen
    assert seen[0] is None and seen[1].agreed and seen[2] is None and run.switched == ["layout"]
    assert [call[0] for call in run.fake.calls] == [[1, 7, -7], [0, 0]]  # vote, then confirmation


def test_a_rank_not_ready_means_no_switch_and_no_confirmation(monkeypatch: pytest.MonkeyPatch) -> None:
    run = _round(monkeypatch, [[0, 7, -7]], 7, 1, passes=1)
    assert run.proposal["result"] is False and not run.seen[0].agreed and run.switched == []
    assert len(run.fake.calls) == 1


@pytest.mark.parametrize("other", ["hang", "raise"])
def test_a_vote_that_does_not_complete_is_fatal_and_releases_the_proposer(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, other: str) -> None:
    """The vote is bounded; when it times out (or raises) the forward loop gets SwitchBroken,
    the proposing thread is released with it instead of waiting forever, and no collective is
    issued again on this rank."""
    with caplog.at_level(logging.CRITICAL, logger="omniinfer"):
        run = _round(monkeypatch, [other], 3, 1, passes=3, timeout_s=0.2)
    assert not run.proposal["thread"].is_alive(), "the proposing thread waits forever"
    assert isinstance(run.proposal.get("error"), SwitchBroken)
    assert all(isinstance(item, SwitchBroken) for item in run.seen) and run.switched == []
    assert "the switch vote at pass 1 did not complete within 0.2 s" in str(run.seen[0])
    assert any("aborting this scheduler" in r.getMessage() for r in caplog.records)
    assert len(run.fake.calls) == 1
    with pytest.raises(SwitchBroken):  # the proposer may not start another collective either
        run.agree.propose(4, 9, "layout")
    assert len(run.fake.calls) == 1


def test_a_switch_that_fails_here_is_fatal_on_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """After an agreed vote the switch raises on this rank: it still joins the confirmation
    (the same collective sequence as every other rank), which tells every rank; all raise."""
    def switch(payload: str) -> None:
        raise ValueError("copy failed")

    run = _round(monkeypatch, [[1, 5, -5], [0, 0]], 5, 1, passes=2, switch=switch)
    seen = run.seen
    assert isinstance(run.proposal.get("error"), SwitchBroken)
    assert "failed on rank(s) [0]" in str(seen[0]) and isinstance(seen[0].__cause__, ValueError)
    assert isinstance(seen[1], SwitchBroken)
    assert [call[0] for call in run.fake.calls] == [[1, 5, -5], [1, 0]]


def test_a_switch_that_failed_on_another_rank_is_fatal_here(monkeypatch: pytest.MonkeyPatch) -> None:
    run = _round(monkeypatch, [[1, 5, -5], [0, 1]], 5, 1, passes=1)  # the other's switch failed
    assert run.switched == ["layout"] and "failed on rank(s) [1]" in str(run.seen[0])
    assert isinstance(run.proposal.get("error"), SwitchBroken)


def test_a_late_vote_from_the_proposer_is_bounded_too(monkeypatch: pytest.MonkeyPatch) -> None:
    fake, agree = _agreement(monkeypatch, ["hang"], timeout_s=0.2)
    _drive(agree, lambda payload: None, 3)  # already past pass 2: the proposer votes "not ready"
    with pytest.raises(SwitchBroken, match="did not complete"):
        agree.propose(1, 2, "layout")
    assert fake.calls[0][0] == [0, 1, -1]
    with pytest.raises(SwitchBroken):  # and the forward loop learns it at its next pass
        agree.pass_end(lambda payload: None)


def test_a_long_wait_for_the_target_pass_is_reported(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """No forward pass runs (an idle server): the proposer keeps waiting, and says so."""
    monkeypatch.setattr(agreement, "WAIT_SLICE_S", 0.02)
    _, agree = _agreement(monkeypatch, [[1, 2, -2], [0, 0]], timeout_s=0.05)
    with caplog.at_level(logging.WARNING, logger="omniinfer"):
        proposal = _proposing(agree, 2, 1)
        _until_posted(agree)
        for _ in range(500):  # the report comes after about timeout_s
            if any("waits for pass 1; this rank is at pass 0" in r.getMessage()
                   for r in caplog.records):
                break
            threading.Event().wait(0.01)
        else:
            raise AssertionError("a long wait was not reported")
        assert proposal["thread"].is_alive()  # reported, still waiting: nothing else is safe
        _drive(agree, lambda payload: None, 1)
        proposal["thread"].join(JOIN_S)
    assert proposal["result"] is True
