"""Workloads where the prefix cache decides: shared prefixes by group, and multi-turn chats.

``prefix-groups`` is the shape of llm-d's prefix-cache benchmark: ``--num-groups`` groups (its
customers), each with a shared prefix of ``--prefix-len`` tokens (a system prompt and its
documents), ``--users-per-group`` users per group, and every request is its group's prefix
followed by a fresh query of ``--query-len`` tokens. Requests go in rounds: in each round every
user of every group sends one query, in a seeded random order.

``multi-turn`` is ``--conversations`` chats of ``--turns`` turns: each turn's prompt is the
previous turn's prompt, that turn's answer (``--output-len`` tokens) and a new user message of
``--turn-len`` tokens. A turn waits for the previous turn's answer and then ``--think-time``
seconds (``BenchRequest.after``). The answer in the next prompt is a fixed text of the answer's
length, not what the server generated, so a worker's cache matches the previous prompt and not
the answer (open-loop runs need the workload fixed in advance).

Token ids come from real text (the shipped public-domain books) tokenized by ``--tokenizer``, so
prompts have the token statistics of prose; without a tokenizer, from seeded random ids.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from importlib import resources
from typing import Any

from omniinfer.bench.workloads import BenchRequest, TokenSource, WorkloadSpec

CORPUS = ("paradise_lost.txt", "tinyshakespeare.txt")
_CORPUS_CACHE: dict[str, list[int]] = {}  # tokenizer name -> corpus ids


class TextTokens:
    """Deterministic token runs cut from real text: the same key always gives the same run.

    Offsets are seeded per key, so different keys start at different places in the corpus and
    share no prefix beyond what chance gives (runs of a few tokens at most).
    """

    def __init__(self, tokenizer: Any, seed: int) -> None:
        name = str(getattr(tokenizer, "name_or_path", "") or "")
        ids = _CORPUS_CACHE.get(name) if name else None
        if ids is None:
            text = "\n".join(resources.files("omniinfer.data").joinpath(f"text/{file}")
                             .read_text("utf-8") for file in CORPUS)
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            if name:
                _CORPUS_CACHE[name] = ids
        self.ids = ids
        self.seed = seed

    def block(self, key: int, length: int) -> list[int]:
        rng = random.Random(f"{self.seed}:{key}")  # a str seed is hashed the same in every run
        out: list[int] = []
        while len(out) < length:  # longer than the corpus: continue from a new offset
            start = rng.randrange(len(self.ids))
            out.extend(self.ids[start:start + length - len(out)])
        return out


Source = TextTokens | TokenSource


def token_source(spec: WorkloadSpec, tokenizer: Any | None) -> Source:
    if tokenizer is None:
        return TokenSource(spec.vocab_size, spec.special_ids, spec.seed)
    return TextTokens(tokenizer, spec.seed)


def _positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def prefix_groups(spec: WorkloadSpec, tokenizer: Any | None = None) -> list[BenchRequest]:
    """Groups × shared prefix × users × fresh query (see the module docstring)."""
    _positive(num_groups=spec.num_groups, prefix_len=spec.prefix_len,
              users_per_group=spec.users_per_group, query_len=spec.query_len,
              output_len=spec.output_len)
    users = [(g, u) for g in range(spec.num_groups) for u in range(spec.users_per_group)]
    n = spec.num_requests or len(users)
    total = spec.prefix_len + spec.query_len + spec.output_len
    if spec.max_total_len is not None and total > spec.max_total_len:
        raise ValueError(f"prefix + query + output = {total} tokens exceeds --max-total-len "
                         f"{spec.max_total_len}")
    tokens = token_source(spec, tokenizer)
    prefixes = [tokens.block(-1 - g, spec.prefix_len) for g in range(spec.num_groups)]
    rng = random.Random(spec.seed)
    order: list[tuple[int, int]] = []
    while len(order) < n:
        round_ = list(users)
        rng.shuffle(round_)
        order.extend(round_)
    out = []
    for i, (group, _user) in enumerate(order[:n]):
        ids = prefixes[group] + tokens.block(i, spec.query_len)
        out.append(BenchRequest(i, len(ids), spec.output_len, input_ids=tuple(ids), group=group))
    return out


def multi_turn(spec: WorkloadSpec, tokenizer: Any | None = None) -> list[BenchRequest]:
    """Chats whose every turn extends the previous prompt and answer (module docstring)."""
    _positive(conversations=spec.conversations, turns=spec.turns, turn_len=spec.turn_len,
              output_len=spec.output_len)
    if spec.think_s < 0:
        raise ValueError("--think-time must be >= 0")
    last = spec.turns * spec.turn_len + spec.turns * spec.output_len
    if spec.max_total_len is not None and last > spec.max_total_len:
        raise ValueError(f"the last turn needs {last} tokens (prompt + answer), more than "
                         f"--max-total-len {spec.max_total_len}")
    tokens = token_source(spec, tokenizer)
    out: list[BenchRequest] = []
    prompts: list[list[int]] = [[] for _ in range(spec.conversations)]
    previous: list[int | None] = [None] * spec.conversations
    for turn in range(spec.turns):  # turn-major, so a turn always comes after the one it follows
        for c in range(spec.conversations):
            key = (c * spec.turns + turn) * 2
            if turn:
                prompts[c] = prompts[c] + tokens.block(key - 1, spec.output_len)  # last answer
            prompts[c] = prompts[c] + tokens.block(key, spec.turn_len)
            index = len(out)
            out.append(BenchRequest(index, len(prompts[c]), spec.output_len,
                                    input_ids=tuple(prompts[c]), after=previous[c],
                                    think_s=spec.think_s if turn else 0.0, group=c))
            previous[c] = index
    return out


PrefixBuilder = Callable[[WorkloadSpec, Any], list[BenchRequest]]
PREFIX_WORKLOADS: dict[str, PrefixBuilder] = {
    "prefix-groups": prefix_groups,
    "multi-turn": multi_turn,
}
