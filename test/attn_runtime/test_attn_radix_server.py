"""Prefix reuse on a patterned real CPU server (SmolLM2): hits, exact outputs, pressure, flush.

One server with ``--omni-attn-pattern`` and the radix cache on (the default). Requests share a
1,000-token prefix and differ after it; each greedy output must equal the masked evaluator's
on the whole prompt (a reused prefix with a missing or stale sink or window would change it),
and later requests must report ``cached_tokens`` well past the sink. Then unrelated prompts
press the tree until it evicts, the shared-prefix requests must still be exact, the pools must
balance once idle, and ``/flush_cache`` must give every slot of both pools back.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from omni_testing import post_json
from omniinfer.attn import evaluator, masks, text
from omniinfer.attn.pattern import Pattern, from_layers

pytestmark = pytest.mark.server

SINK, RECENT, NEW_TOKENS = 16, 64, 12
PREFIX = 1000
MAX_TOTAL_TOKENS = 4096
SWA_RATIO = 0.25


@pytest.fixture(scope="module")
def model_dir() -> Path:
    path = evaluator.DEFAULT_MODEL
    assert path.is_dir(), f"SmolLM2 is expected at {path}"
    return path


@pytest.fixture(scope="module")
def pattern(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Pattern:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    return from_layers(range(0, config.num_hidden_layers, 2), config, SINK, RECENT, str(model_dir))


@pytest.fixture(scope="module")
def server(model_dir: Path, pattern: Pattern,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from omniinfer.launch import SGLangServer, cpu_env, cpu_server_command, free_port

    path = tmp_path_factory.mktemp("attn-radix") / "pattern.json"
    pattern.save(path)
    port = free_port()
    command = cpu_server_command(
        model_dir, port, max_total_tokens=MAX_TOTAL_TOKENS,
        extra_args=["--omni-attn-pattern", str(path), "--swa-full-tokens-ratio", str(SWA_RATIO),
                    "--chunked-prefill-size", "512"],
    )
    assert "--disable-radix-cache" not in command
    log = tmp_path_factory.mktemp("logs") / "attn-radix-server.log"
    with SGLangServer(command, cpu_env(), log, port, ready_timeout_s=600) as running:
        yield running


@pytest.fixture(scope="module")
def tokens(model_dir: Path) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return tokenizer.encode(text.read("paradise_lost")[10000:90000])


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Any:
    model, _ = evaluator.load_model(model_dir)
    return model


def masked_greedy(model: Any, prompt: list[int], new: int, pattern: Pattern) -> list[int]:
    """Greedy decoding under the evaluator's masks over a cache that keeps every token."""
    from transformers import DynamicCache

    windows = masks.windows_for(pattern.mask, pattern.sink, pattern.recent)
    cache, out, step = DynamicCache(config=model.config), [], torch.tensor([prompt])
    with torch.inference_mode():
        for _ in range(new):
            logits = model(input_ids=step, past_key_values=cache, use_cache=True,
                           omni_windows=windows).logits[0, -1]
            out.append(int(logits.argmax()))
            step = torch.tensor([[out[-1]]])
    return out


def generate(base_url: str, prompt: list[int], new: int = NEW_TOKENS) -> dict[str, Any]:
    return post_json(f"{base_url}/generate", {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True},
    }, timeout=1800)


def attn_status(base_url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{base_url}/omni/attn", timeout=30) as reply:
        return json.loads(reply.read())


def _idle_status(base_url: str, settled: Any) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    status = attn_status(base_url)
    while time.monotonic() < deadline and not settled(status):
        time.sleep(0.5)
        status = attn_status(base_url)
    return status


def _balanced(status: dict[str, Any]) -> bool:
    book = status["radix"]["ledger"]
    return all(p["free"] + p["evictable"] + p["protected"] == p["capacity"] for p in book.values())


def _suffix(tokens: list[int], i: int) -> list[int]:
    start = 12_000 + 97 * i
    return tokens[start : start + 40]


def test_the_sink_aware_tree_serves_the_prefix_cache(server: Any) -> None:
    radix = attn_status(server.base_url)["radix"]
    assert radix is not None
    assert radix["sink_rules"] is True and radix["swa_component"] == "SinkSWAComponent"
    assert radix["tree_core"] == "UnifiedTreeCore"  # the Python core: it calls our component


def test_shared_prefix_is_reused_and_outputs_equal_the_masked_evaluator(
    server: Any, reference: Any, pattern: Pattern, tokens: list[int]
) -> None:
    prefix = tokens[:PREFIX]
    cached = []
    for i in range(4):
        prompt = prefix + _suffix(tokens, i)
        reply = generate(server.base_url, prompt)
        cached.append(reply["meta_info"]["cached_tokens"])
        assert reply["output_ids"] == masked_greedy(reference, prompt, NEW_TOKENS, pattern), i
    # The first request finds nothing; from the third on, the shared prefix is a hit.
    assert cached[0] == 0
    assert max(cached[2:]) >= PREFIX - RECENT, cached
    assert attn_status(server.base_url)["radix"]["sink_nodes_stored"] > 0


def test_after_pressure_evicts_the_tree_outputs_stay_exact(
    server: Any, reference: Any, pattern: Pattern, tokens: list[int]
) -> None:
    for i in range(6):  # unrelated 1,200-token prompts: more than the pools hold together
        generate(server.base_url, tokens[2000 + 1500 * i : 3200 + 1500 * i], 2)
    radix = attn_status(server.base_url)["radix"]
    assert radix["sink_evictions_refused"] + radix["sink_splits"] > 0  # eviction met sinks
    prefix = tokens[:PREFIX]
    for i in range(4, 7):
        prompt = prefix + _suffix(tokens, i)
        reply = generate(server.base_url, prompt)
        assert reply["output_ids"] == masked_greedy(reference, prompt, NEW_TOKENS, pattern), i
    assert reply["meta_info"]["cached_tokens"] > SINK


def test_idle_pools_balance_and_flush_frees_both(server: Any, tokens: list[int]) -> None:
    generate(server.base_url, tokens[:PREFIX] + _suffix(tokens, 9), 4)
    status = _idle_status(server.base_url, _balanced)
    assert _balanced(status), status["radix"]["ledger"]
    assert status["radix"]["ledger"]["compressed"]["evictable"] > 0  # the tree holds KV
    with urllib.request.urlopen(f"{server.base_url}/flush_cache", timeout=60) as reply:
        assert reply.status == 200
    pools = status["pools"]

    def empty(s: dict[str, Any]) -> bool:
        return (s["usage"]["full_tokens_free"] == pools["full"]["tokens"]
                and s["usage"]["compressed_tokens_free"] == pools["compressed"]["tokens"])

    status = _idle_status(server.base_url, empty)
    assert empty(status), status["usage"]
    assert status["radix"]["ledger"]["compressed"]["evictable"] == 0
