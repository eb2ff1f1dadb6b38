"""The layout switch happens on the same forward pass on every rank, or on none.

Two real gloo ranks drive :class:`PlacementController` (see ``switch_harness``); rank 1's
background thread stalls right after the ranks agreed on the switch pass, as a thread starved of
the GIL during fast passes does, so its staged layout is posted after that pass went by.
"""

from __future__ import annotations

import switch_harness


def test_a_late_rank_never_switches_at_another_pass_than_the_others() -> None:
    seen = switch_harness.run("delay_after_target")
    rank0, rank1 = seen[0], seen[1]
    assert rank0["updates"], "the hot expert must be replicated at some point"
    # every metadata switch happened at the same pass on both ranks (or on neither)
    assert rank0["updates"] == rank1["updates"]
    assert rank0["map"] == rank1["map"]
    assert rank0["weights_match"] and rank1["weights_match"]
    # the stalled attempt was abandoned by both, counted, and retried at a new agreed pass
    counters0, counters1 = rank0["status"]["counters"], rank1["status"]["counters"]
    assert counters0["switches_aborted"] == counters1["switches_aborted"] >= 1
    assert counters0["migrations_adopted"] == counters1["migrations_adopted"] == len(rank0["updates"])


def test_a_rank_late_at_every_attempt_leaves_the_old_layout_on_every_rank() -> None:
    from omniinfer.sglang_plugin.placement.runtime import SWITCH_ATTEMPTS

    seen = switch_harness.run("delay_every_attempt")
    rank0, rank1 = seen[0], seen[1]
    assert rank0["updates"] == rank1["updates"] and rank0["map"] == rank1["map"]
    assert rank0["weights_match"] and rank1["weights_match"]
    assert rank0["status"]["counters"] | {"decisions": 0} == rank1["status"]["counters"]
    for rank in (rank0, rank1):
        counters, first = rank["status"]["counters"], rank["status"]["migrations"][0]
        assert counters["switches_aborted"] >= SWITCH_ATTEMPTS and counters["migrations_abandoned"] >= 1
        assert first["state"].startswith("abandoned") and "switched_at_pass" not in first
        assert len(first["aborted_switch_passes"]) == SWITCH_ATTEMPTS
    # the next decision proposes the layout again; nobody is late any more: adopted everywhere
    assert rank0["updates"] and rank0["status"]["counters"]["migrations_adopted"] == 1


def test_ranks_counting_passes_differently_abort_loudly_instead_of_hanging() -> None:
    """Rank 1 counts one pass more: it reaches the agreed pass one real pass early and waits in
    the vote while rank 0 waits for it in the forward pass's collective. The vote is bounded:
    rank 1's scheduler aborts with the reason, its background thread stops, and rank 0's next
    collective with it fails (SGLang's launcher then stops the instance); nobody switched."""
    seen = switch_harness.run("skew", deadline_s=100)
    rank0, rank1 = seen[0], seen[1]
    error = rank1["error"]
    assert error is not None and error["type"] == "SwitchBroken"
    assert "did not complete within 4 s" in error["message"]
    assert any(level == "CRITICAL" and "aborting this scheduler" in text for level, text in rank1["log"])
    assert not rank1["thread_alive"]
    assert rank0["error"] is not None  # its peer is gone: it cannot keep serving either
    assert rank0["updates"] == rank1["updates"] == []
