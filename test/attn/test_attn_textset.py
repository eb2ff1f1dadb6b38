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


def test_reference_pass_is_kept_on_disk_and_reused(
    tiny_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, _ = evaluator.load_model(tiny_models["llama"])
    vocab = int(model.config.vocab_size)
    windows = [[(3 * i + 5) % vocab for i in range(80)]]
    first = evaluator.Evaluator(model, windows, 4, 16, reference_dir=tmp_path)
    assert len(list(tmp_path.glob("reference-*.pt"))) == 1
    fresh = evaluator.Evaluator(model, windows, 4, 16).evaluate((True, False))
    calls: list[int] = []
    real = evaluator.score_windows
    monkeypatch.setattr(evaluator, "score_windows",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    again = evaluator.Evaluator(model, windows, 4, 16, reference_dir=tmp_path)
    assert calls == []  # the reference came from disk
    assert again.evaluate((True, False)).drop == pytest.approx(fresh.drop, abs=1e-9)
    assert first.evaluate((True, False)).drop == pytest.approx(fresh.drop, abs=1e-9)
    evaluator.Evaluator(model, windows, 8, 16, reference_dir=tmp_path)  # another start
    other = [[(5 * i + 2) % vocab for i in range(80)]]
    evaluator.Evaluator(model, other, 4, 16, reference_dir=tmp_path)  # other tokens
    assert len(list(tmp_path.glob("reference-*.pt"))) == 3
