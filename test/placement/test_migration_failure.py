"""A migration that fails is logged with its cause, counted, reported, and not retried.

Two real gloo ranks drive :class:`PlacementController` (see ``switch_harness``); SGLang's
``ExpertLocationMetadata.init_by_mapping`` raises on rank 1 for the first layout it is given.
"""

from __future__ import annotations

import switch_harness


def test_a_failed_layout_is_reported_with_its_cause_and_not_retried() -> None:
    seen = switch_harness.run("fail_init")
    rank0, rank1 = seen[0], seen[1]
    failed_layout = rank1["asked"][0]
    # never asked for again, on any rank, although the load keeps asking for it
    assert [rank["asked"].count(failed_layout) for rank in (rank0, rank1)] == [1, 1]
    assert rank0["updates"] == rank1["updates"] == []  # the old layout kept serving everywhere
    # the failing rank logs the cause (type and message) and the traceback only at debug
    cause = "ValueError: no room for expert 3 on rank 0"
    errors = [text for level, text in rank1["log"] if level == "ERROR"]
    assert any(cause in text and "Traceback" not in text for text in errors)
    assert any("Traceback" in text for level, text in rank1["log"] if level == "DEBUG")
    # rank 0 (the one writing /omni/placement) counts it and names the cause on rank 1
    status = rank0["status"]
    assert status["counters"]["migrations_failed"] == 1
    assert status["counters"]["layouts_skipped"] >= 1
    failure = status["last_failure"]
    assert failure["causes"] == {"1": cause} and failure["layout"] == status["migrations"][0]["layout"]
    assert status["migrations"][0]["state"] == "failed; old layout kept"
    assert len(status["migrations"]) == 1


def test_a_switch_failing_on_one_rank_after_the_vote_aborts_every_rank_at_that_pass() -> None:
    """Rank 1's metadata update raises after both ranks agreed to switch. Both ranks confirm the
    switch in one more vote, so both learn it at the same pass and both abort loudly (the maps
    may differ and the live weights may be half written); neither background thread issues
    another collective."""
    seen = switch_harness.run("fail_switch", deadline_s=100)
    rank0, rank1 = seen[0], seen[1]
    for rank in (rank0, rank1):
        assert rank["error"] is not None and rank["error"]["type"] == "SwitchBroken"
        assert "failed on rank(s) [1] after every rank agreed to it" in rank["error"]["message"]
        assert any(level == "CRITICAL" for level, _ in rank["log"])
        assert not rank["thread_alive"]
    assert rank0["error"]["pass"] == rank1["error"]["pass"]
    assert [p for p, _ in rank0["updates"]] == [rank0["error"]["pass"]] and rank1["updates"] == []
    cause = "RuntimeError: device lost while updating the expert map"
    assert any(level == "ERROR" and cause in text for level, text in rank1["log"])
