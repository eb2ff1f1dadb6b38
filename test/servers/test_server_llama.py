"""The real SGLang engine on this CPU, with the plugin loaded, against transformers."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from omni_testing import hf_greedy, post_json

pytestmark = pytest.mark.server

PROMPTS = [
    "First Citizen:\nBefore we proceed any further, hear me speak.",
    "ROMEO:\nBut, soft! what light through yonder window breaks?",
    "To be, or not to be",
]
NEW_TOKENS = 24


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_output_equals_transformers(
    llama_server: Any, tiny_models: dict[str, Path], prompt: str
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_models["llama"])
    input_ids = tokenizer.encode(prompt, add_special_tokens=False)
    reply = post_json(
        f"{llama_server.base_url}/generate",
        {
            "input_ids": input_ids,
            "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True},
        },
    )
    assert reply["meta_info"]["completion_tokens"] == NEW_TOKENS
    assert reply["output_ids"] == hf_greedy(tiny_models["llama"], input_ids, NEW_TOKENS)


def test_chat_completion_answers(llama_server: Any) -> None:
    reply = post_json(
        f"{llama_server.base_url}/v1/chat/completions",
        {
            "model": "default",
            "messages": [{"role": "user", "content": "Who is there?"}],
            "max_tokens": 8,
            "temperature": 0.0,
        },
    )
    choice = reply["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert reply["usage"]["completion_tokens"] >= 1


def test_omni_flag_values_reach_the_scheduler(llama_server: Any) -> None:
    log = llama_server.log_path.read_text(errors="replace")
    lines = [line for line in log.splitlines() if "omniinfer: scheduler tp_rank=0 received" in line]
    assert lines, "the scheduler process did not load the plugin"
    assert re.search(r'"omni_placement_window": 7\b', lines[0])
