"""OmniAttn in the real SGLang CPU server on SmolLM2: outputs, freed memory, admission, status.

This server runs with ``--disable-radix-cache``: it pins the no-prefix-reuse path (every slot of
both pools back once idle). Prefix reuse on a patterned server is ``test_attn_radix_server.py``.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attn_serving as serving
import pytest

from omniinfer.attn.pattern import Pattern

pytestmark = pytest.mark.server

SINK, RECENT, NEW_TOKENS = serving.SINK, serving.RECENT, 16
MAX_TOTAL_TOKENS = 4096
SWA_RATIO = 0.25  # compressed-pool tokens per full-pool token for this server
LONG_CONTEXT, LONG_NEW = 640, 24  # admission requests: 616-token prompts + 24 new tokens
PROMPTS = [(0, 220), (3000, 390)]  # (offset, length) of the equality prompts: both cross the window


@pytest.fixture(scope="module")
def server(model_dir: Path, pattern: tuple[Pattern, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    log = tmp_path_factory.mktemp("logs") / "attn-server.log"
    extra = ["--swa-full-tokens-ratio", str(SWA_RATIO), "--disable-radix-cache"]
    with serving.patterned_server(model_dir, pattern[1], MAX_TOTAL_TOKENS, extra, log) as running:
        yield running


@pytest.fixture(scope="module")
def tokens(model_dir: Path) -> list[int]:
    return serving.book_tokens(model_dir, 20000, 60000)


@pytest.mark.parametrize(("offset", "length"), PROMPTS)
def test_greedy_output_equals_the_masked_evaluator(
    server: Any, reference: Any, pattern: tuple[Pattern, Path], tokens: list[int],
    offset: int, length: int,
) -> None:
    prompt = tokens[offset : offset + length]
    assert length > SINK + RECENT  # the window is crossed during prefill already
    reply = serving.generate(server.base_url, prompt, NEW_TOKENS)
    want = serving.masked_greedy(reference, prompt, NEW_TOKENS, serving.windows(pattern[0]))
    assert reply["output_ids"] == want


def test_the_pattern_changes_the_output(reference: Any, tokens: list[int],
                                        pattern: tuple[Pattern, Path]) -> None:
    """Guards the equality test: on its prompts the pattern's output is not the full model's."""
    windows = serving.windows(pattern[0])
    differs = [
        serving.masked_greedy(reference, tokens[o : o + n], NEW_TOKENS, windows)
        != serving.masked_greedy(reference, tokens[o : o + n], NEW_TOKENS, None)
        for o, n in PROMPTS
    ]
    assert any(differs)


def _peak_running(base_url: str, prompts: list[list[int]]) -> tuple[int, list[Any]]:
    replies: list[Any] = [None] * len(prompts)

    def one(i: int) -> None:
        replies[i] = serving.generate(base_url, prompts[i], LONG_NEW)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    peak = 0
    while any(t.is_alive() for t in threads):
        with urllib.request.urlopen(f"{base_url}/v1/loads", timeout=30) as reply:
            loads = json.loads(reply.read())
        rows = loads.get("loads", [loads])
        peak = max(peak, sum(int(r.get("num_running_reqs", 0)) for r in rows))
        time.sleep(0.3)
    for t in threads:
        t.join()
    return peak, replies


def test_admits_more_long_requests_than_the_budget_holds_uncompressed(
    server: Any, tokens: list[int]
) -> None:
    prompt_len = LONG_CONTEXT - LONG_NEW
    uncompressed_bound = MAX_TOTAL_TOKENS // LONG_CONTEXT  # every layer holds every token
    prompts = [tokens[i * prompt_len : (i + 1) * prompt_len] for i in range(uncompressed_bound + 3)]
    peak, replies = _peak_running(server.base_url, prompts)
    assert all(r["meta_info"]["completion_tokens"] == LONG_NEW for r in replies)
    assert peak > uncompressed_bound


def test_status_reports_pools_freed_slots_and_no_leak(server: Any, pattern: tuple[Pattern, Path],
                                                      tokens: list[int]) -> None:
    serving.generate(server.base_url, tokens[:400], 8)  # at least one request crossed the window

    def idle(status: dict[str, Any]) -> bool:
        pools = status["pools"]
        return (status["usage"]["full_tokens_free"] == pools["full"]["tokens"]
                and status["usage"]["compressed_tokens_free"] == pools["compressed"]["tokens"])

    status = serving.wait_status(server.base_url, idle, timeout_s=30)
    pools = status["pools"]
    assert status["pattern"]["compressed_layers"] == list(pattern[0].compressed_layers)
    # Idle again: every slot of both pools is back (sink slots included).
    assert status["usage"]["full_tokens_free"] == pools["full"]["tokens"]
    assert status["usage"]["compressed_tokens_free"] == pools["compressed"]["tokens"]
    # The two pools spend what --max-total-tokens tokens cost without a pattern.
    spent = pools["full"]["bytes"] + pools["compressed"]["bytes"]
    assert abs(spent - pools["uncompressed_bytes_for_max_total_tokens"]) / spent < 0.01
    assert pools["full"]["tokens"] > MAX_TOTAL_TOKENS
    assert pools["compressed"]["tokens"] < pools["full"]["tokens"]
    assert status["tokens_freed"] > 0
    assert status["compressed_keys_read"] < status["compressed_keys_full_attention"]


def test_prefill_frees_out_of_window_prompt_slots_before_the_first_decode(
    server: Any, tokens: list[int]
) -> None:
    from omniinfer.attn import runtime_window as rw

    before = serving.attn_status(server.base_url)["tokens_freed"]
    # Two new tokens: one decode step, whose own eviction waits for the second decode step, so
    # only the after-prefill free can have released the prompt's out-of-window slots.
    reply = serving.generate(server.base_url, tokens[5000:5400], 2)
    assert reply["meta_info"]["completion_tokens"] == 2
    lo, hi = rw.freeable_range(pre_len=400, sink=SINK, recent=RECENT, cursor=0, interval=1)
    status = serving.wait_status(server.base_url, lambda s: s["tokens_freed"] - before >= hi - lo,
                         timeout_s=30)
    assert status["tokens_freed"] - before == hi - lo
