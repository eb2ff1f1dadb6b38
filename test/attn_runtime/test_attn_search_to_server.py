"""``omniinfer attn search`` on a user's model end to end: the search writes a pattern file, a
real SGLang server loads it, and its greedy outputs are the masked evaluator's for that file."""

from __future__ import annotations

from pathlib import Path

import attn_serving as serving
import pytest

from omniinfer.attn import evaluator, pattern
from omniinfer.cli import main

pytestmark = pytest.mark.server

SINK, RECENT, NEW_TOKENS = 16, 64, 12


def test_a_searched_pattern_serves_in_a_real_server(
    tiny_models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tiny_models["llama"]
    output = tmp_path / "searched.json"
    code = main(["attn", "search", "--model", str(model), "--context", "256", "--sink",
                 str(SINK), "--recent", str(RECENT), "--max-drop", "0.2", "--budget", "6",
                 "--population", "3", "--generations", "2", "--retrieval-cases", "1",
                 "--output", str(output), "--no-progress"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    found = pattern.load(output)
    assert found.model_id == model.name and found.compressed_layers
    reference, tokenizer = evaluator.load_model(model)
    prompt = tokenizer("\n".join(["To be, or not to be, that is the question."] * 30),
                       add_special_tokens=False)["input_ids"][:200]
    assert len(prompt) > SINK + RECENT  # the window is crossed in the prefill
    want = serving.masked_greedy(reference, prompt, NEW_TOKENS, serving.windows(found))
    log = tmp_path / "searched-server.log"
    with serving.patterned_server(model, output, 4096, ["--disable-radix-cache"], log) as server:
        reply = serving.generate(server.base_url, prompt, NEW_TOKENS)
    assert reply["output_ids"] == want
