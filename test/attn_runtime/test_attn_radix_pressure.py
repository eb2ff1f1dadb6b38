"""A patterned real CPU server with the radix cache at memory pressure, without overlap.

The normal (non-overlap) scheduler loop runs the post-prefill window free after every chunk
of a chunked prefill; it must skip the chunks, or it frees slots never allocated (the
allocator's double-free assertion kills the scheduler at the first chunk). Then a burst of
long, distinct prompts, more than the pools hold together, with a sink as large as the
window: every request must be answered, the first ones exactly as the masked evaluator
decodes them, and the idle pools must balance. (That admission never counts a running
request's sink as evictable is pinned on SGLang's tree in ``test_attn_radix_tree``; the
crash it caused at 2K takes ``benchmark/attn_runtime/admission.py`` to reproduce.)
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attn_serving as serving
import pytest

from omniinfer.attn.pattern import Pattern

pytestmark = pytest.mark.server

NEW_TOKENS = 8
PROMPT = 700  # three chunks of 256
SINK = 64
MAX_TOTAL_TOKENS = 3072


@pytest.fixture(scope="module")
def pattern(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Pattern, Path]:
    """Every other layer compressed, with a sink as large as the window: a running request's
    sink is half of what it holds in the compressed pool."""
    from transformers import AutoConfig

    layers = AutoConfig.from_pretrained(model_dir).num_hidden_layers
    return serving.saved_pattern(model_dir, range(0, layers, 2), SINK, SINK,
                                 tmp_path_factory.mktemp("attn-pattern"))


@pytest.fixture(scope="module")
def server(model_dir: Path, pattern: tuple[Pattern, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    log = tmp_path_factory.mktemp("logs") / "attn-radix-pressure.log"
    extra = ["--disable-overlap-schedule", "--chunked-prefill-size", "256",
             "--swa-full-tokens-ratio", "0.3"]
    with serving.patterned_server(model_dir, pattern[1], MAX_TOTAL_TOKENS, extra, log) as running:
        yield running


@pytest.fixture(scope="module")
def prompts(model_dir: Path) -> list[list[int]]:
    tokens = serving.book_tokens(model_dir, 0, 80000)
    return [tokens[i * PROMPT : (i + 1) * PROMPT] for i in range(13)]


def test_a_chunked_prompt_without_overlap_is_exact(
    server: Any, reference: Any, pattern: tuple[Pattern, Path], prompts: list[list[int]]
) -> None:
    reply = serving.generate(server.base_url, prompts[0], NEW_TOKENS)
    want = serving.masked_greedy(reference, prompts[0], NEW_TOKENS, serving.windows(pattern[0]))
    assert reply["output_ids"] == want


def test_a_burst_past_the_pools_is_answered_and_the_pools_balance(
    server: Any, reference: Any, pattern: tuple[Pattern, Path], prompts: list[list[int]]
) -> None:
    burst = prompts[1:]
    with ThreadPoolExecutor(len(burst)) as pool:
        replies = list(pool.map(lambda p: serving.generate(server.base_url, p, NEW_TOKENS),
                                burst))
    assert all(len(r["output_ids"]) == NEW_TOKENS for r in replies)
    windows = serving.windows(pattern[0])
    for prompt, reply in list(zip(burst, replies, strict=True))[:2]:
        assert reply["output_ids"] == serving.masked_greedy(reference, prompt, NEW_TOKENS,
                                                            windows)
    status = serving.wait_status(server.base_url, serving.pools_balanced)
    assert serving.pools_balanced(status), status["radix"]["ledger"]
