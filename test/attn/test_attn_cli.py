"""A small search end to end through the command line, then evaluating its pattern."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omniinfer.attn import pattern, retrieval, text
from omniinfer.cli import main

SMALL = ["--context", "128", "--sink", "4", "--recent", "16"]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_search_then_eval_end_to_end(
    arch: str, tiny_models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tiny_models[arch]
    output = tmp_path / "pattern.json"
    code = main([
        "attn", "search", "--model", str(model), "--context", "256", "--sink", "4", "--recent",
        "16", "--max-drop", "0.05", "--budget", "6", "--population", "4", "--generations", "3",
        "--seed", "1", "--baselines", "greedy,first-k", "--retrieval-cases", "2",
        "--output", str(output),
        "--no-progress",
    ])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "ga: " in printed and "greedy: " in printed and "first-k: " in printed
    for line in ("memory: weights ", "per pattern: 1 perplexity window(s)", "8 retrieval case(s)",
                 "search: at most 6 patterns x 3 method(s)", "retrieval: the full model answers"):
        assert line in printed
    found = pattern.load(output, config={"num_hidden_layers": 2, "num_key_value_heads": 2,
                                         "head_dim": 32}, model_id=str(model))
    assert (found.sink, found.recent, found.num_layers) == (4, 16, 2)
    assert found.compressed_layers and found.provenance["fitness"]["drop"] <= 0.05
    assert found.model_id == arch and found.provenance["objective"] == "perplexity and retrieval"
    fitness = found.provenance["fitness"]
    assert fitness["retrieval_cases"] == 8 and fitness["max_retrieval_drop"] == 5.0
    assert fitness["retrieval_loss_points"] <= 5.0
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


def test_a_retrieval_loss_beyond_its_bound_makes_a_pattern_infeasible() -> None:
    """The search ranks by the folded figure: a pattern within the perplexity bound that loses
    retrieval is not chosen, whatever it saves."""
    from omniinfer.attn.search import GA, SearchSettings, best_of, run_search

    def evaluate(genome: tuple[bool, ...]) -> dict[str, float]:
        loses = genome[0]  # compressing layer 0 evicts the needle
        return {"drop": 0.0, "constraint": retrieval.constraint(0.0, 0.01, 40.0 if loses else 0.0,
                                                                 5.0)}

    settings = SearchSettings(max_drop=0.01, budget=16, methods=(GA, "greedy"), key="constraint")
    results = run_search(evaluate, 4, settings, None, progress=False)
    for result in results.values():
        best = best_of(result)
        assert best is not None and not best[0] and sum(best) == 3
    plain = run_search(evaluate, 4, SearchSettings(max_drop=0.01, budget=16, methods=("greedy",)),
                       None, progress=False)
    assert best_of(plain["greedy"]) == (True, True, True, True)  # perplexity alone takes it


def test_a_model_family_it_cannot_mask_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoConfig

    folder = tmp_path / "gpt2"
    AutoConfig.for_model("gpt2", n_layer=1, n_head=2, n_embd=32).save_pretrained(folder)
    code = main(["attn", "search", "--model", str(folder), "--output", str(tmp_path / "p.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "model type 'gpt2' is not one the search can mask" in err[0]
    sliding = tmp_path / "mistral"
    AutoConfig.for_model("mistral", num_hidden_layers=2, sliding_window=64).save_pretrained(sliding)
    code = main(["attn", "search", "--model", str(sliding), "--output", str(tmp_path / "m.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "sliding-window attention" in err[0]


def test_a_missing_device_and_a_run_folder_of_another_search_are_refused(
    tiny_models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    model, output = tiny_models["llama"], tmp_path / "p.json"
    if not torch.cuda.is_available():
        code = main(["attn", "search", "--model", str(model), *SMALL, "--device", "cuda",
                     "--output", str(output)])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and err == ["omniinfer: error: --device cuda: no CUDA device is visible"]
    run_dir = tmp_path / "run"
    common = ["attn", "search", "--model", str(model), "--context", "256", "--sink", "4",
              "--recent", "16", "--max-drop", "0.05", "--budget",
              "2", "--population", "3", "--generations", "1", "--run-dir", str(run_dir),
              "--output", str(output), "--no-progress"]
    assert main([*common, "--retrieval-cases", "1"]) in (0, 2)  # 2: nothing within the bound
    assert "holds a search" not in capsys.readouterr().err
    assert (run_dir / "objective.json").exists()
    code = main([*common, "--retrieval-cases", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "holds a search with other settings" in err[0]


def test_the_memory_estimate_scales_the_saved_dtype_to_float32(tmp_path: Path) -> None:
    from omniinfer.attn import cost

    (tmp_path / "model.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / "pytorch_model.bin").write_bytes(b"x" * 5000)  # one format only is counted
    (tmp_path / "config.json").write_text('{"dtype": "bfloat16"}')
    assert cost.weight_bytes(tmp_path) == 2000
    (tmp_path / "config.json").write_text("{}")
    assert cost.weight_bytes(tmp_path) == 1000


def test_bad_bounds_and_an_old_run_folder_are_refused_in_one_line(
    tiny_models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, output = tiny_models["llama"], tmp_path / "p.json"
    for bad in (["--max-drop", "0"], ["--retrieval-haystacks", ","]):
        assert main(["attn", "search", "--model", str(model), *bad, "--output", str(output)]) == 2
        assert len(capsys.readouterr().err.strip().splitlines()) == 1
    old = tmp_path / "old.run"
    old.mkdir()
    (old / "evaluations.json").write_text("{}")
    code = main(["attn", "search", "--model", str(model), "--run-dir", str(old), "--output",
                 str(output)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "recorded no objective" in err[0]
