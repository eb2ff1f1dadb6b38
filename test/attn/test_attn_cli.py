"""A small search end to end through the command line, then evaluating its pattern."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omniinfer.attn import pattern, text
from omniinfer.cli import main

SMALL = ["--context", "128", "--sink", "4", "--recent", "16"]


def test_search_then_eval_end_to_end(
    tiny_models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tiny_models["llama"]
    output = tmp_path / "pattern.json"
    code = main([
        "attn", "search", "--model", str(model), *SMALL, "--max-drop", "0.05",
        "--budget", "6", "--population", "4", "--generations", "3", "--seed", "1",
        "--baselines", "greedy,first-k", "--output", str(output), "--no-progress",
    ])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "ga: " in printed and "greedy: " in printed and "first-k: " in printed
    found = pattern.load(output, config={"num_hidden_layers": 2, "num_key_value_heads": 2,
                                         "head_dim": 32}, model_id=str(model))
    assert (found.sink, found.recent, found.num_layers) == (4, 16, 2)
    assert found.compressed_layers and found.provenance["fitness"]["drop"] <= 0.05
    assert found.provenance["evaluations"] <= 6 and found.provenance["seed"] == 1
    run_dir = output.with_suffix(".run")
    cached = json.loads((run_dir / "evaluations.json").read_text())
    assert (run_dir / "ga-checkpoint.json").exists() and len(cached) >= 3

    report_path = tmp_path / "eval.json"
    code = main([
        "attn", "eval", "--model", str(model), "--pattern", str(output), "--context", "128",
        "--windows", "1", "--passkey", "2", "--output", str(report_path),
    ])
    assert code == 0
    report, printed = json.loads(report_path.read_text()), capsys.readouterr().out
    for key in ("ppl_full", "ppl_pattern", "kv_saved_fraction", "next_token_agreement",
                "passkey_full", "passkey_pattern"):
        assert key in report and f"{key}: " in printed
    assert report["kv_saved_fraction"] == found.kv_saved_fraction(128) > 0
    assert 0.0 <= report["next_token_agreement"] <= 1.0
    assert report["tokens_scored"] == 128 - 20 - 1


def test_eval_rejects_a_pattern_for_another_model(
    tiny_models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.json"
    pattern.Pattern("llama", 30, 4, 16, (0, 29)).save(bad)
    code = main(["attn", "eval", "--model", str(tiny_models["llama"]), "--pattern", str(bad)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "pattern has 30 layers, model has 2" in err[0]


def test_search_and_heldout_text_do_not_overlap() -> None:
    book = text.read("paradise_lost")
    search, heldout = text.part(book, "search"), text.part(book, "heldout")
    assert search + heldout == book and book.startswith("Book I")
    assert search[-2000:] not in heldout and heldout[:2000] not in search
