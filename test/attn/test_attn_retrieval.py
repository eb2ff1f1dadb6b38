"""Retrieval as a search constraint: bands, the loss in points, the folded bound, the cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from omniinfer.attn import evaluator, passkey, retrieval
from omniinfer.attn.retrieval import Band


def test_the_loss_is_the_worst_band_drop_in_points_and_failing_full_bands_do_not_count() -> None:
    a, b, c = Band("passkey", "repeat", 0), Band("multikey", "repeat", 2), Band("passkey", "t", 4)
    full = {a: 1.0, b: 0.5, c: 0.0}
    assert retrieval.loss_points(full, {a: 1.0, b: 0.5, c: 0.0}) == (0.0, None)
    assert retrieval.loss_points(full, {a: 0.75, b: 0.0, c: 0.0}) == (50.0, b)
    assert retrieval.loss_points(full, {a: 1.0, b: 1.0, c: 1.0}) == (0.0, None)  # gains are not losses
    assert retrieval.loss_points(full, {a: 1.0}) == (50.0, b)  # a missing band scores zero
    assert b.label == "multikey/repeat/0.4-0.6"
    bands = [a, a, b, b]
    assert retrieval.accuracy_by_band(bands, [True, False, True, True]) == {a: 0.5, b: 1.0}


def test_the_folded_constraint_is_within_the_bound_exactly_when_both_bounds_hold() -> None:
    for ppl, loss in ((0.004, 0.0), (0.01, 5.0), (0.011, 0.0), (0.0, 5.1), (0.02, 100.0)):
        folded = retrieval.constraint(ppl, 0.01, loss, 5.0)
        assert (folded <= 0.01) == (ppl <= 0.01 and loss <= 5.0)
    assert retrieval.constraint(0.0, 0.01, 10.0, 5.0) == pytest.approx(0.02)  # 2x the bound
    with pytest.raises(ValueError):
        retrieval.constraint(0.0, 0.0, 1.0, 5.0)


def test_a_check_on_a_real_model_scores_patterns_and_keeps_the_full_answers(
    tiny_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, tokenizer = evaluator.load_model(tiny_models["llama"])
    check = retrieval.RetrievalCheck(model, tokenizer, 256, 2, cache_dir=tmp_path)
    assert len(check.cases) == 2 * 2 * 2  # two haystacks, two kinds, two depths
    assert {b.haystack for b in check.bands} == {passkey.REPEATED_FILLER, "tinyshakespeare"}
    assert {b.kind for b in check.bands} == set(passkey.KINDS)
    scored = check.score((True, False), 4, 16)
    assert scored["retrieval_cases"] == 8 and 0.0 <= scored["retrieval_pattern"] <= 1.0
    assert scored["retrieval_loss_points"] >= 0.0
    calls = []
    real = passkey.retrieved
    monkeypatch.setattr(passkey, "retrieved", lambda *a: calls.append(a[2]) or real(*a))
    again = retrieval.RetrievalCheck(model, tokenizer, 256, 2, cache_dir=tmp_path)
    assert calls == [] and again.full_passed == check.full_passed  # read back, not recomputed
    heldout = retrieval.RetrievalCheck(model, tokenizer, 256, 2, part="heldout")
    natural = [c.ids for c, b in zip(heldout.cases, heldout.bands, strict=True)
               if b.haystack == "tinyshakespeare"]
    searched = [c.ids for c, b in zip(check.cases, check.bands, strict=True)
                if b.haystack == "tinyshakespeare"]
    assert natural and not set(natural) & set(searched)  # a judgement never reuses search text
