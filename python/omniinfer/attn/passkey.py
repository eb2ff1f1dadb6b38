"""Passkey retrieval: a five-digit key hidden at some depth of a long public-domain haystack.

Two kinds: ``passkey`` hides one key; ``multikey`` hides three keys, each for a door of another
colour, and asks for one of them (the asked one at the case's depth, the others a third and two
thirds of the haystack further on, wrapping), so a model must find the right needle among
look-alikes rather than the only number in the text.

The model passes a case when greedy decoding after the question would produce the key. That
is checked in one forward pass over prompt + key: greedy produces the key exactly when the
argmax at every answer position equals the next key token (teacher forcing on the key is then
identical to free-running greedy). In compressed layers the needle is evicted once it is more
than ``recent`` tokens back, so only full layers can carry it to the question.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from omniinfer.attn import masks

INTRO = (
    "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the pass key.\n"
)
NEEDLE = "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "\nWhat is the pass key? The pass key is"
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
KINDS = ("passkey", "multikey")
DOORS = ("red", "green", "blue")
MULTI_NEEDLE = "\nThe pass key for the {door} door is {key}. Remember it.\n"
MULTI_QUESTION = "\nWhat is the pass key for the {door} door? The pass key for the {door} door is"
# The classic passkey filler: a few bland sentences repeated, so that the key is the only thing
# in the context worth remembering. SmolLM2-135M, which rarely finds a key in real prose at 4K
# and never at 8K, finds it here, so the check can compare patterns at those contexts.
FILLER = ("The sky is clear and the wind is calm. The river runs past the old mill. "
          "The birds sing in the trees. Then the day goes on as before. ")
REPEATED_FILLER = "repeat"


def repeated_filler(tokens: int) -> str:
    """``FILLER`` repeated to at least ``10 * tokens`` characters: at least ``tokens`` tokens,
    since none of its tokens spans more than ten characters (``build_cases`` raises if a
    haystack is still too short)."""
    return FILLER * (10 * tokens // len(FILLER) + 1)


@dataclass(frozen=True)
class PasskeyCase:
    ids: tuple[int, ...]
    answer_start: int  # index of the first key token in ids
    depth: float
    key: str
    kind: str = "passkey"


def build_cases(
    tokenizer: Any, haystack: str, context: int, depths: Sequence[float] = DEPTHS, seed: int = 0,
    kind: str = "passkey",
) -> list[PasskeyCase]:
    """One case per depth, each exactly ``context`` tokens long, from different haystack text."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    rng = random.Random(seed)
    hay = tokenizer(haystack, add_special_tokens=False)["input_ids"]

    def encode(part: str) -> list[int]:
        return tokenizer(part, add_special_tokens=False)["input_ids"]

    intro = encode(INTRO)
    cases = []
    for index, depth in enumerate(depths):
        if kind == "passkey":
            key = str(rng.randint(10000, 99999))
            needles = [(depth, encode(NEEDLE.format(key=key)))]
            question = encode(QUESTION)
        else:
            keys = [str(rng.randint(10000, 99999)) for _ in DOORS]
            asked = rng.randrange(len(DOORS))
            key = keys[asked]
            needles = sorted(((depth + k / len(DOORS)) % 1.0,
                              encode(MULTI_NEEDLE.format(door=DOORS[(asked + k) % len(DOORS)],
                                                         key=keys[(asked + k) % len(DOORS)])))
                             for k in range(len(DOORS)))
            question = encode(MULTI_QUESTION.format(door=DOORS[asked]))
        answer = encode(" " + key)
        room = context - len(intro) - sum(len(n) for _, n in needles) - len(question) - len(answer)
        start = index * room
        if room <= 0:
            raise ValueError(f"{context} tokens leave no room for haystack in a {kind} case")
        if start + room > len(hay):
            raise ValueError(f"haystack too short for {len(depths)} cases of {context} tokens")
        filler = hay[start : start + room]
        ids, done = list(intro), 0
        for at, needle in needles:
            cut = max(done, int(at * room))
            ids += filler[done:cut] + needle
            done = cut
        ids += filler[done:] + question + answer
        cases.append(PasskeyCase(tuple(ids), len(ids) - len(answer), depth, key, kind))
    return cases


def retrieved(model: Any, cases: Sequence[PasskeyCase], windows: masks.Windows | None) -> list[bool]:
    """Whether greedy decoding would return each case's key under the given layer windows."""
    return [passed for passed, _ in answer_scores(model, cases, windows)]


def answer_scores(model: Any, cases: Sequence[PasskeyCase],
                  windows: masks.Windows | None) -> list[tuple[bool, float]]:
    """Per case: whether greedy decoding would return the key, and the key's log-probability
    (the sum over its tokens, teacher-forced): a continuous figure that shows a small loss
    that pass or fail does not."""
    backbone, head = model.get_decoder(), model.get_output_embeddings()
    results = []
    with torch.inference_mode():
        for case in cases:
            ids = torch.tensor([case.ids], device=model.device)
            hidden = backbone(input_ids=ids, omni_windows=windows).last_hidden_state[0]
            logits = head(hidden[case.answer_start - 1 : -1]).float()
            answer = ids[0, case.answer_start :]
            passed = bool((logits.argmax(dim=-1) == answer).all())
            logprob = torch.log_softmax(logits, dim=-1).gather(1, answer[:, None]).sum()
            results.append((passed, float(logprob)))
    return results
