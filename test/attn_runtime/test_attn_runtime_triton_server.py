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
from attn_serving import generate, masked_greedy, patterned_server, saved_pattern

from omniinfer.attn import evaluator, masks
from omniinfer.attn.pattern import Pattern
from omniinfer.cpu.server_env import cpu_env

pytestmark = pytest.mark.server

SINK, RECENT, NEW_TOKENS, PAGE = 4, 8, 12, 16
PROMPT_LENS = (40, 70)  # both cross sink + recent, the second over several pages


@pytest.fixture(scope="module")
def pattern(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
            ) -> tuple[Pattern, Path]:
    return saved_pattern(tiny_models["llama"], [0], SINK, RECENT,
                         tmp_path_factory.mktemp("triton-pattern"))


@pytest.fixture(scope="module")
def server(tiny_models: dict[str, Path], pattern: tuple[Pattern, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    env = cpu_env()
    env["TRITON_INTERPRET"] = "1"
    log = tmp_path_factory.mktemp("logs") / "triton-attn-server.log"
    extra = ["--attention-backend", "omni_triton", "--page-size", str(PAGE),
             "--swa-full-tokens-ratio", "0.5"]
    with patterned_server(tiny_models["llama"], pattern[1], 2048, extra, log, env) as running:
        yield running


def test_omni_triton_server_equals_the_masked_evaluator(
        server: Any, tiny_models: dict[str, Path], pattern: tuple[Pattern, Path]) -> None:
    model, _ = evaluator.load_model(tiny_models["llama"])
    windows = masks.windows_for(pattern[0].mask, SINK, RECENT)
    gen = torch.Generator().manual_seed(0)
    changed = 0
    for length in PROMPT_LENS:
        prompt = torch.randint(10, model.config.vocab_size, (length,), generator=gen).tolist()
        reply = generate(server.base_url, prompt, NEW_TOKENS, timeout=600)
        want = masked_greedy(model, prompt, NEW_TOKENS, windows)
        assert reply["output_ids"] == want, length
        changed += want != masked_greedy(model, prompt, NEW_TOKENS, None)
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
        reply = generate(server.base_url, prompt, NEW_TOKENS, timeout=600)
        assert reply["output_ids"] == masked_greedy(model, prompt, NEW_TOKENS, windows)
        cached.append(reply["meta_info"]["cached_tokens"])
    assert max(cached[2:]) >= 4 * PAGE, cached  # past the sink's page: the prefix was reused
