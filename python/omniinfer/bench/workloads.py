"""Workloads: what to send, how long the prompt is, how many tokens to generate."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from importlib import resources
from typing import Any


@dataclasses.dataclass(frozen=True)
class BenchRequest:
    """One request of a workload."""

    index: int
    prompt: str
    prompt_tokens: int
    output_tokens: int
    arrival_s: float = 0.0  # offset from the start, used by trace replay only


def _corpus() -> str:
    return resources.files("omniinfer.data").joinpath("text/tinyshakespeare.txt").read_text("utf-8")


def random_text(
    tokenizer: Any, num_requests: int, input_len: int, output_len: int, range_ratio: float, seed: int
) -> list[BenchRequest]:
    """Prompts cut from real text at random offsets, lengths uniform in [ratio·len, len].

    Real text (not random ids) keeps the tokenizer round trip exact, so the server sees the
    number of prompt tokens the benchmark reports.
    """
    if num_requests < 1 or input_len < 1 or output_len < 1:
        raise ValueError("num_requests, input_len and output_len must be positive")
    if not 0.0 < range_ratio <= 1.0:
        raise ValueError("range_ratio must be in (0, 1]")
    rng = random.Random(seed)
    ids = tokenizer.encode(_corpus()[:400_000], add_special_tokens=False)
    if len(ids) <= input_len:
        raise ValueError(f"input_len {input_len} exceeds the corpus ({len(ids)} tokens)")
    requests = []
    for i in range(num_requests):
        n_in = rng.randint(max(1, int(input_len * range_ratio)), input_len)
        n_out = rng.randint(max(1, int(output_len * range_ratio)), output_len)
        start = rng.randrange(0, len(ids) - n_in)
        prompt = tokenizer.decode(ids[start : start + n_in])
        n_in = len(tokenizer.encode(prompt, add_special_tokens=False))
        requests.append(BenchRequest(i, prompt, n_in, n_out))
    return requests


WORKLOADS: dict[str, Callable[..., list[BenchRequest]]] = {"random": random_text}
