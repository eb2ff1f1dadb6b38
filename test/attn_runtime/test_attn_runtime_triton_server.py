"""A patterned real SGLang server on ``--attention-backend omni_triton``, kernels interpreted.

The tiny Llama (2 layers, layer 0 compressed with sink 4 + recent 8) runs on the CPU engine with
``TRITON_INTERPRET=1`` at ``--page-size 16``: full layers go through SGLang's own Triton kernels,
the compressed layer through the sgl-kernel-npu decode and extend kernels over the SWA sub-pool.
Its greedy outputs must equal the masked evaluator's token for token, also when requests reuse
a shared prefix through the sink-aware radix cache (on by default with a pattern).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from omni_testing import post_json
from omniinfer.attn import evaluator, masks
from omniinfer.attn.pattern import Pattern, from_layers

pytestmark = pytest.mark.server

SINK, RECENT, NEW_TOKENS, PAGE = 4, 8, 12, 16
PROMPT_LENS = (40, 70)  # both cross sink + recent, the second over several pages


@pytest.fixture(scope="module")
def pattern(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
            ) -> tuple[Pattern, Path]:
    from transformers import AutoConfig

    model = tiny_models["llama"]
    made = from_layers([0], AutoConfig.from_pretrained(model), SINK, RECENT, str(model))
    path = tmp_path_factory.mktemp("triton-pattern") / "pattern.json"
    made.save(path)
    return made, path


@pytest.fixture(scope="module")
def server(tiny_models: dict[str, Path], pattern: tuple[Pattern, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from omniinfer.launch import SGLangServer, cpu_env, cpu_server_command, free_port

    port = free_port()
    command = cpu_server_command(
        tiny_models["llama"], port, max_total_tokens=2048,
        extra_args=["--omni-attn-pattern", str(pattern[1]), "--attention-backend", "omni_triton",
                    "--page-size", str(PAGE), "--swa-full-tokens-ratio", "0.5"],
    )
    env = cpu_env()
    env["TRITON_INTERPRET"] = "1"
    log = tmp_path_factory.mktemp("logs") / "triton-attn-server.log"
    with SGLangServer(command, env, log, port, ready_timeout_s=600) as running:
        yield running


def _greedy(model: Any, prompt: list[int], windows: masks.Windows | None) -> list[int]:
    from transformers import DynamicCache

    cache, out, step = DynamicCache(config=model.config), [], torch.tensor([prompt])
    with torch.inference_mode():
        for _ in range(NEW_TOKENS):
            logits = model(input_ids=step, past_key_values=cache, use_cache=True,
                           omni_windows=windows).logits[0, -1]
            out.append(int(logits.argmax()))
            step = torch.tensor([[out[-1]]])
    return out


def test_omni_triton_server_equals_the_masked_evaluator(
        server: Any, tiny_models: dict[str, Path], pattern: tuple[Pattern, Path]) -> None:
    model, _ = evaluator.load_model(tiny_models["llama"])
    windows = masks.windows_for(pattern[0].mask, SINK, RECENT)
    gen = torch.Generator().manual_seed(0)
    changed = 0
    for length in PROMPT_LENS:
        prompt = torch.randint(10, model.config.vocab_size, (length,), generator=gen).tolist()
        reply = post_json(f"{server.base_url}/generate", {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0.0,
                                "ignore_eos": True},
        }, timeout=600)
        want = _greedy(model, prompt, windows)
        assert reply["output_ids"] == want, length
        changed += want != _greedy(model, prompt, None)
    assert changed > 0  # the window matters for these prompts, so equality means something


def test_omni_triton_reuses_a_shared_prefix_exactly(
        server: Any, tiny_models: dict[str, Path], pattern: tuple[Pattern, Path]) -> None:
    model, _ = evaluator.load_model(tiny_models["llama"])
    windows = masks.windows_for(pattern[0].mask, SINK, RECENT)
    gen = torch.Generator().manual_seed(1)
    prefix = torch.randint(10, model.config.vocab_size, (6 * PAGE,), generator=gen).tolist()
    cached = []
    for _ in range(4):
        prompt = prefix + torch.randint(10, model.config.vocab_size, (20,), generator=gen).tolist()
        reply = post_json(f"{server.base_url}/generate", {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0.0,
                                "ignore_eos": True},
        }, timeout=600)
        assert reply["output_ids"] == _greedy(model, prompt, windows)
        cached.append(reply["meta_info"]["cached_tokens"])
    assert max(cached[2:]) >= 4 * PAGE, cached  # past the sink's page: the prefix was reused
