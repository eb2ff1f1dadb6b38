"""Passkey cases on the classic repeated filler, with the real SmolLM2 tokenizer."""

from __future__ import annotations

import pytest

from omniinfer.attn import evaluator, passkey


@pytest.fixture(scope="module")
def tokenizer():  # noqa: ANN201 - a transformers tokenizer
    from transformers import AutoTokenizer

    if not (evaluator.DEFAULT_MODEL / "tokenizer.json").exists():
        pytest.fail(f"{evaluator.DEFAULT_MODEL} is missing: run scripts/setup.sh")
    return AutoTokenizer.from_pretrained(evaluator.DEFAULT_MODEL)


def test_repeated_filler_holds_cases_of_the_asked_length(tokenizer) -> None:  # noqa: ANN001
    context, depths = 1024, (0.1, 0.5, 0.9)
    haystack = passkey.repeated_filler(context * len(depths))
    assert len(tokenizer(haystack, add_special_tokens=False)["input_ids"]) >= context * len(depths)
    cases = passkey.build_cases(tokenizer, haystack, context, depths, seed=3)
    assert [len(c.ids) for c in cases] == [context] * len(depths)
    for case in cases:
        answer = tokenizer.decode(list(case.ids[case.answer_start:]))
        assert answer.strip() == case.key
        prompt = tokenizer.decode(list(case.ids[:case.answer_start]))
        needle = prompt.index(f"The pass key is {case.key}.")
        filler = prompt[len(passkey.INTRO):]
        share = (needle - len(passkey.INTRO)) / len(filler)
        assert abs(share - case.depth) < 0.05  # the needle sits at its depth
        assert passkey.FILLER.split(".")[0] in prompt


def test_too_short_a_haystack_is_refused(tokenizer) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="haystack too short"):
        passkey.build_cases(tokenizer, passkey.FILLER * 3, 1024, (0.5,))


def test_multikey_cases_ask_for_one_door_among_three_look_alikes(tokenizer) -> None:  # noqa: ANN001
    context, depths = 1024, (0.1, 0.5, 0.9)
    haystack = passkey.repeated_filler(context * len(depths))
    cases = passkey.build_cases(tokenizer, haystack, context, depths, seed=5, kind="multikey")
    assert [len(c.ids) for c in cases] == [context] * len(depths)
    assert {c.kind for c in cases} == {"multikey"}
    for case in cases:
        prompt = tokenizer.decode(list(case.ids[:case.answer_start]))
        assert tokenizer.decode(list(case.ids[case.answer_start:])).strip() == case.key
        asked = prompt.rsplit("What is the pass key for the ", 1)[1].split(" door")[0]
        assert asked in passkey.DOORS
        keys = {door: prompt.split(f"The pass key for the {door} door is ")[1][:5]
                for door in passkey.DOORS}
        assert keys[asked] == case.key and len(set(keys.values())) == 3  # three different keys
        at = prompt.index(f"The pass key for the {asked} door is")
        filler_start = len(passkey.INTRO)
        share = (at - filler_start) / (len(prompt) - filler_start)
        assert abs(share - case.depth) < 0.08  # the asked needle sits at the case's depth


def test_an_unknown_kind_is_refused(tokenizer) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="kind must be one of"):
        passkey.build_cases(tokenizer, passkey.repeated_filler(2048), 1024, (0.5,), kind="lines")
