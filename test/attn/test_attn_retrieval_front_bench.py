"""benchmark/attn/retrieval_front.py end to end on the tiny random Llama, and the key's
log-probability it ranks layers by."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark" / "attn"))

import retrieval_front  # noqa: E402

from omniinfer.attn import evaluator, masks, passkey, pattern, retrieval  # noqa: E402


def test_answer_scores_agree_with_retrieved_and_a_window_lowers_the_key(
        tiny_models: dict[str, Path]) -> None:
    model, tokenizer = evaluator.load_model(tiny_models["llama"])
    cases = retrieval.RetrievalCheck(model, tokenizer, 256, 2, [passkey.REPEATED_FILLER]).cases
    full = passkey.answer_scores(model, cases, None)
    assert [passed for passed, _ in full] == passkey.retrieved(model, cases, None)
    assert all(logprob <= 0.0 for _, logprob in full)
    windows = masks.windows_for((True, True), 4, 16)
    evicted = passkey.answer_scores(model, cases, windows)
    assert [lp for _, lp in evicted] != [lp for _, lp in full]  # the window changes the key's odds


def test_the_front_runs_ranks_judges_and_writes_the_shipped_pattern(
        tiny_models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, written = tmp_path / "front.json", tmp_path / "shipped.json"
    code = retrieval_front.main([
        "--model", str(tiny_models["llama"]), "--context", "256", "--sink", "4", "--recent", "16",
        "--search-texts", "paradise_lost", "--search-windows", "1", "--search-cases", "1",
        "--judge-texts", "alice,kjv_exodus", "--judge-windows", "1", "--judge-cases", "1",
        "--ks", "1", "--max-drop", "10", "--max-retrieval-drop", "100", "--out", str(out),
        "--write-pattern", str(written), "--reference-dir", str(tmp_path / "reference"),
        "--no-progress"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    result = json.loads(out.read_text())
    assert sorted(result["ranking"]["order"]) == [0, 1]
    assert len(result["ranking"]["ppl_drop"]) == len(result["ranking"]["key_logprob_drop"]) == 2
    (point,) = result["front"]
    assert point["k"] == 1 and point["first_k"]["layers"] == [0]
    assert point["ranked"]["layers"] == result["ranking"]["order"][:1]
    assert result["shipped_k"] == 1 and result["binding"] == []  # loose bounds: it holds
    assert result["full_retrieval"]["judged_cases"] == 4  # 2 haystacks x 2 kinds x 1
    assert "passes: ranking 10, front 12" in printed and "shipped point: k = 1; no larger point was judged" in printed
    assert out.with_suffix(".png").stat().st_size > 0
    assert len(list((tmp_path / "reference").glob("reference-*.pt"))) == 3  # one per window set
    shipped = pattern.load(written)
    assert list(shipped.compressed_layers) == point["ranked"]["layers"]
    assert shipped.provenance["context"] == 256 and shipped.model_id == "llama"
