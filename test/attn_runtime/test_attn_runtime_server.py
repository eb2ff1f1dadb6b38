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

import pytest
import torch

from omni_testing import post_json
from omniinfer.attn import evaluator, masks, text
from omniinfer.attn.pattern import Pattern, from_layers

pytestmark = pytest.mark.server

SINK, RECENT, NEW_TOKENS = 16, 64, 16
MAX_TOTAL_TOKENS = 4096
SWA_RATIO = 0.25  # compressed-pool tokens per full-pool token for this server
LONG_CONTEXT, LONG_NEW = 640, 24  # admission requests: 616-token prompts + 24 new tokens
PROMPTS = [(0, 220), (3000, 390)]  # (offset, length) of the equality prompts: both cross the window


@pytest.fixture(scope="module")
def model_dir() -> Path:
    path = evaluator.DEFAULT_MODEL
    assert path.is_dir(), f"SmolLM2 is expected at {path}"
    return path


@pytest.fixture(scope="module")
def pattern(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Pattern, Path]:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    chosen = range(0, config.num_hidden_layers, 2)  # every other layer, first one included
    made = from_layers(chosen, config, SINK, RECENT, str(model_dir))
    path = tmp_path_factory.mktemp("attn-pattern") / "pattern.json"
    made.save(path)
    return made, path


@pytest.fixture(scope="module")
def server(model_dir: Path, pattern: tuple[Pattern, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from omniinfer.launch import SGLangServer, cpu_env, cpu_server_command, free_port

    port = free_port()
    command = cpu_server_command(
        model_dir, port, max_total_tokens=MAX_TOTAL_TOKENS,
        extra_args=["--omni-attn-pattern", str(pattern[1]),
                    "--swa-full-tokens-ratio", str(SWA_RATIO), "--disable-radix-cache"],
    )
    log = tmp_path_factory.mktemp("logs") / "attn-server.log"
    with SGLangServer(command, cpu_env(), log, port, ready_timeout_s=600) as running:
        yield running


@pytest.fixture(scope="module")
def tokens(model_dir: Path) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return tokenizer.encode(text.read("paradise_lost")[20000:60000])


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Any:
    model, _ = evaluator.load_model(model_dir)
    return model


def masked_greedy(model: Any, prompt: list[int], new: int, windows: masks.Windows | None) -> list[int]:
    """Greedy decoding under the evaluator's masks, over a cache that keeps every token."""
    from transformers import DynamicCache

    cache, out, step = DynamicCache(config=model.config), [], torch.tensor([prompt])
    with torch.inference_mode():
        for _ in range(new):
            logits = model(input_ids=step, past_key_values=cache, use_cache=True,
                           omni_windows=windows).logits[0, -1]
            out.append(int(logits.argmax()))
            step = torch.tensor([[out[-1]]])
    return out


def generate(base_url: str, prompt: list[int], new: int) -> dict[str, Any]:
    return post_json(f"{base_url}/generate", {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True},
    }, timeout=1800)


def attn_status(base_url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{base_url}/omni/attn", timeout=30) as reply:
        return json.loads(reply.read())


@pytest.mark.parametrize(("offset", "length"), PROMPTS)
def test_greedy_output_equals_the_masked_evaluator(
    server: Any, reference: Any, pattern: tuple[Pattern, Path], tokens: list[int],
    offset: int, length: int,
) -> None:
    made = pattern[0]
    prompt = tokens[offset : offset + length]
    assert length > SINK + RECENT  # the window is crossed during prefill already
    reply = generate(server.base_url, prompt, NEW_TOKENS)
    windows = masks.windows_for(made.mask, made.sink, made.recent)
    assert reply["output_ids"] == masked_greedy(reference, prompt, NEW_TOKENS, windows)


def test_the_pattern_changes_the_output(reference: Any, tokens: list[int],
                                        pattern: tuple[Pattern, Path]) -> None:
    """Guards the equality test: on its prompts the pattern's output is not the full model's."""
    made = pattern[0]
    windows = masks.windows_for(made.mask, made.sink, made.recent)
    differs = [
        masked_greedy(reference, tokens[o : o + n], NEW_TOKENS, windows)
        != masked_greedy(reference, tokens[o : o + n], NEW_TOKENS, None)
        for o, n in PROMPTS
    ]
    assert any(differs)


def _peak_running(base_url: str, prompts: list[list[int]]) -> tuple[int, list[Any]]:
    replies: list[Any] = [None] * len(prompts)

    def one(i: int) -> None:
        replies[i] = generate(base_url, prompts[i], LONG_NEW)

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
    generate(server.base_url, tokens[:400], 8)  # at least one request crossed the window
    deadline = time.monotonic() + 30
    status = attn_status(server.base_url)
    pools = status["pools"]
    while time.monotonic() < deadline and (
        status["usage"]["full_tokens_free"] != pools["full"]["tokens"]
        or status["usage"]["compressed_tokens_free"] != pools["compressed"]["tokens"]
    ):
        time.sleep(0.5)
        status = attn_status(server.base_url)
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

    before = attn_status(server.base_url)["tokens_freed"]
    # Two new tokens: one decode step, whose own eviction waits for the second decode step, so
    # only the after-prefill free can have released the prompt's out-of-window slots.
    reply = generate(server.base_url, tokens[5000:5400], 2)
    assert reply["meta_info"]["completion_tokens"] == 2
    lo, hi = rw.freeable_range(pre_len=400, sink=SINK, recent=RECENT, cursor=0, interval=1)
    deadline = time.monotonic() + 30
    freed = attn_status(server.base_url)["tokens_freed"] - before
    while freed < hi - lo and time.monotonic() < deadline:
        time.sleep(0.5)
        freed = attn_status(server.base_url)["tokens_freed"] - before
    assert freed == hi - lo
