"""Shared fixtures: tiny models built once per session, real SGLang servers started once."""

from __future__ import annotations

import json
import os
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def post_json(url: str, body: dict[str, Any], timeout: float = 120.0) -> Any:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny random Llama and Qwen3-MoE sharing one locally trained tokenizer."""
    from omniinfer.models import tiny

    root = tmp_path_factory.mktemp("tiny-models")
    tokenizer = tiny.train_tokenizer()
    return {
        arch: tiny.build(arch, root / arch, seed=0, tokenizer=tokenizer)
        for arch in ("llama", "qwen3_moe")
    }


@pytest.fixture(scope="session")
def cpu_engine_env() -> dict[str, str]:
    from omniinfer.launch import cpu_env

    return cpu_env()


@pytest.fixture(scope="session")
def llama_server(
    tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    """One real SGLang server on the tiny Llama with the plugin loaded and an omni flag set."""
    from omniinfer.launch import SGLangServer, cpu_env, cpu_server_command, free_port

    port = free_port()
    command = cpu_server_command(
        tiny_models["llama"], port, max_total_tokens=4096,
        extra_args=["--omni-placement-window", "7"],
    )
    log = tmp_path_factory.mktemp("logs") / "llama-server.log"
    with SGLangServer(command, cpu_env(), log, port) as server:
        yield server


def hf_greedy(model_dir: Path, input_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by Hugging Face transformers in float32 (the reference)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([input_ids])
    produced: list[int] = []
    past = None
    with torch.no_grad():
        for _ in range(max_new_tokens):  # plain argmax loop: no EOS handling, no logit processors
            out = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            token = int(out.logits[0, -1].argmax())
            produced.append(token)
            ids = torch.tensor([[token]])
    return produced


def pytest_configure(config: pytest.Config) -> None:
    # Tests start real servers in subprocesses with this interpreter's venv.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    config.addinivalue_line("markers", "server: starts a real SGLang server")
    assert sys.version_info >= (3, 10)
