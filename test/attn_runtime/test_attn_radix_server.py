"""Prefix reuse on a patterned real CPU server (SmolLM2): hits, exact outputs, pressure, flush.

One server with ``--omni-attn-pattern`` and the radix cache on (the default). Requests share a
1,000-token prefix and differ after it; each greedy output must equal the masked evaluator's
on the whole prompt (a reused prefix with a missing or stale sink or window would change it),
and later requests must report ``cached_tokens`` well past the sink. Then unrelated prompts
press the tree until it evicts, the shared-prefix requests must still be exact, the pools must
balance once idle, and ``/flush_cache`` must give every slot of both pools back.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attn_serving as serving
import pytest

from omniinfer.attn.pattern import Pattern

pytestmark = pytest.mark.server

SINK, RECENT, NEW_TOKENS = serving.SINK, serving.RECENT, 12
PREFIX = 1000
MAX_TOTAL_TOKENS = 4096
SWA_RATIO = 0.25


@pytest.fixture(scope="module")
def server(model_dir: Path, pattern: tuple[Pattern, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    log = tmp_path_factory.mktemp("logs") / "attn-radix-server.log"
    extra = ["--swa-full-tokens-ratio", str(SWA_RATIO), "--chunked-prefill-size", "512"]
    with serving.patterned_server(model_dir, pattern[1], MAX_TOTAL_TOKENS, extra, log) as running:
        assert "--disable-radix-cache" not in running.command
        yield running


@pytest.fixture(scope="module")
def tokens(model_dir: Path) -> list[int]:
    return serving.book_tokens(model_dir, 10000, 90000)


def _suffix(tokens: list[int], i: int) -> list[int]:
    start = 12_000 + 97 * i
    return tokens[start : start + 40]


def test_the_sink_aware_tree_serves_the_prefix_cache(server: Any) -> None:
    radix = serving.attn_status(server.base_url)["radix"]
    assert radix is not None
    assert radix["sink_rules"] is True and radix["swa_component"] == "SinkSWAComponent"
    assert radix["tree_core"] == "UnifiedTreeCore"  # the Python core: it calls our component


def test_shared_prefix_is_reused_and_outputs_equal_the_masked_evaluator(
    server: Any, reference: Any, pattern: tuple[Pattern, Path], tokens: list[int]
) -> None:
    prefix, windows = tokens[:PREFIX], serving.windows(pattern[0])
    cached = []
    for i in range(4):
        prompt = prefix + _suffix(tokens, i)
        reply = serving.generate(server.base_url, prompt, NEW_TOKENS)
        cached.append(reply["meta_info"]["cached_tokens"])
        want = serving.masked_greedy(reference, prompt, NEW_TOKENS, windows)
        assert reply["output_ids"] == want, i
    # The first request finds nothing; from the third on, the shared prefix is a hit.
    assert cached[0] == 0
    assert max(cached[2:]) >= PREFIX - RECENT, cached
    assert serving.attn_status(server.base_url)["radix"]["sink_nodes_stored"] > 0


def test_after_pressure_evicts_the_tree_outputs_stay_exact(
    server: Any, reference: Any, pattern: tuple[Pattern, Path], tokens: list[int]
) -> None:
    for i in range(6):  # unrelated 1,200-token prompts: more than the pools hold together
        serving.generate(server.base_url, tokens[2000 + 1500 * i : 3200 + 1500 * i], 2)
    radix = serving.attn_status(server.base_url)["radix"]
    met = radix["sink_evictions_refused"] + radix["sink_splits"] + radix["sink_subtree_leaves"]
    assert met > 0  # eviction met sinks
    prefix, windows = tokens[:PREFIX], serving.windows(pattern[0])
    for i in range(4, 7):
        prompt = prefix + _suffix(tokens, i)
        reply = serving.generate(server.base_url, prompt, NEW_TOKENS)
        want = serving.masked_greedy(reference, prompt, NEW_TOKENS, windows)
        assert reply["output_ids"] == want, i
    assert reply["meta_info"]["cached_tokens"] > SINK


def test_idle_pools_balance_and_flush_frees_both(server: Any, tokens: list[int]) -> None:
    serving.generate(server.base_url, tokens[:PREFIX] + _suffix(tokens, 9), 4)
    status = serving.wait_status(server.base_url, serving.pools_balanced)
    assert serving.pools_balanced(status), status["radix"]["ledger"]
    assert status["radix"]["ledger"]["compressed"]["evictable"] > 0  # the tree holds KV
    with urllib.request.urlopen(f"{server.base_url}/flush_cache", timeout=60) as reply:
        assert reply.status == 200
    pools = status["pools"]

    def empty(s: dict[str, Any]) -> bool:
        return (s["usage"]["full_tokens_free"] == pools["full"]["tokens"]
                and s["usage"]["compressed_tokens_free"] == pools["compressed"]["tokens"])

    status = serving.wait_status(server.base_url, empty)
    assert empty(status), status["usage"]
    assert status["radix"]["ledger"]["compressed"]["evictable"] == 0
