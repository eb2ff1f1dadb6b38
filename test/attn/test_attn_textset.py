"""The shipped evaluation texts and the several-text evaluator the generalising search uses."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest

from omniinfer.attn import evaluator, text


def test_every_shipped_text_reads_and_has_its_source_and_licence_listed() -> None:
    sources = resources.files("omniinfer.data").joinpath("text/SOURCES.md").read_text("utf-8")
    for name, (filename, start) in text.SHIPPED.items():
        body = text.read(name)
        assert len(body) > 50_000, name  # room for five 2K-token windows (~4 characters a token)
        assert f"`{filename}`" in sources, f"{filename} has no row in SOURCES.md"
        if start is not None:  # the preamble before the marker is cut off
            assert body.startswith(start[1:]), name
        search, heldout = text.part(body, "search"), text.part(body, "heldout")
        assert search + heldout == body and search.strip() and heldout.strip()


def test_text_set_is_judged_by_its_worst_text(tiny_models: dict[str, Path]) -> None:
    model, _ = evaluator.load_model(tiny_models["llama"])
    vocab = int(model.config.vocab_size)
    windows = {
        "a": [[(7 * i + 3) % vocab for i in range(96)]],
        "b": [[(i * i + 11) % vocab for i in range(96)], [(5 * i + 1) % vocab for i in range(96)]],
    }
    ev = evaluator.TextSetEvaluator(model, windows, sink=4, recent=16)
    pattern = (True, False)
    record = ev.evaluate(pattern)
    alone = {name: evaluator.Evaluator(model, w, 4, 16).evaluate(pattern) for name, w in
             windows.items()}
    assert set(record["texts"]) == {"a", "b"}
    for name, metrics in alone.items():
        assert record["texts"][name]["drop"] == pytest.approx(metrics.drop, abs=1e-9)
    worst = max(alone, key=lambda n: alone[n].drop)
    assert record["worst_text"] == worst
    assert record["drop"] == pytest.approx(alone[worst].drop, abs=1e-9)
    assert record["drop_mean"] == pytest.approx(
        (alone["a"].drop + alone["b"].drop) / 2, abs=1e-9)
    assert record["tokens"] == sum(m.tokens for m in alone.values())
    with pytest.raises(ValueError, match="no texts"):
        evaluator.TextSetEvaluator(model, {}, sink=4, recent=16)
