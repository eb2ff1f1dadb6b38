"""The shipped 4K pattern (sink 128 + recent 896) on a real SGLang CPU server: a 3,000-token
prompt crosses its window, and the server's greedy tokens are the masked evaluator's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attn_serving as serving
import pytest

from omniinfer.attn import pattern as patterns

pytestmark = pytest.mark.server

SHIPPED_4K = Path(patterns.__file__).parent / "patterns" / "smollm2-135m-4k.json"
PROMPT_TOKENS, NEW_TOKENS = 3000, 12


def test_the_shipped_4k_pattern_serves_the_evaluators_tokens(
        model_dir: Path, reference: Any, tmp_path: Path) -> None:
    shipped = patterns.load(SHIPPED_4K)
    assert (shipped.sink, shipped.recent, shipped.provenance["context"]) == (128, 896, 4096)
    prompt = serving.book_tokens(model_dir, 20000, 36000)[:PROMPT_TOKENS]
    assert len(prompt) == PROMPT_TOKENS > shipped.sink + shipped.recent
    want = serving.masked_greedy(reference, prompt, NEW_TOKENS, serving.windows(shipped))
    full = serving.masked_greedy(reference, prompt, NEW_TOKENS, None)
    assert want != full  # the eviction changes the answer, so equality below says something
    with serving.patterned_server(model_dir, SHIPPED_4K, 16384, [],
                                  tmp_path / "server.log") as server:
        answer = serving.generate(server.base_url, prompt, NEW_TOKENS)
        status = serving.attn_status(server.base_url)
    assert answer["output_ids"] == want
    assert status["pattern"]["recent"] == 896
    assert status["pattern"]["compressed_layers"] == list(shipped.compressed_layers)
