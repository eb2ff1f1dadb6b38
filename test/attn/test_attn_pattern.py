"""Pattern files: round trip, the memory figure, and one clear message per mismatch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omniinfer.attn import pattern
from omniinfer.attn.pattern import Pattern, PatternError

SMOLLM2 = {"num_hidden_layers": 30, "num_key_value_heads": 3, "head_dim": 64,
           "num_attention_heads": 9, "hidden_size": 576}


def _pattern(**changes: object) -> Pattern:
    fields = dict(model_id="SmolLM2-135M-Instruct", num_layers=30, sink=64, recent=256,
                  compressed_layers=(3, 1, 2), model_shape={"num_key_value_heads": 3,
                                                            "head_dim": 64})
    fields.update(changes)
    return Pattern(**fields)  # type: ignore[arg-type]


def test_round_trip_keeps_every_field(tmp_path: Path) -> None:
    original = pattern.from_layers([5, 1], SMOLLM2, 128, 384, "SmolLM2-135M-Instruct",
                                   {"seed": 3, "budget": 60})
    original.save(tmp_path / "p.json")
    loaded = pattern.load(tmp_path / "p.json", config=SMOLLM2,
                          model_id="HuggingFaceTB/SmolLM2-135M-Instruct")
    assert loaded == original
    assert loaded.compressed_layers == (1, 5)
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["format"] == "omniinfer.attn.pattern" and data["version"] == 1
    assert data["model"] == {"id": "SmolLM2-135M-Instruct", "num_layers": 30,
                             "num_key_value_heads": 3, "head_dim": 64}
    assert loaded.mask[1] and loaded.mask[5] and sum(loaded.mask) == 2
    assert loaded.window(5) == (128, 384) and loaded.window(0) is None


def test_kv_saved_matches_the_measured_baselines() -> None:
    # design figures for SmolLM2 at 2K, sink 64 + recent 256: all layers 84 %, half 42 %
    assert _pattern(compressed_layers=tuple(range(30))).kv_saved_fraction(2048) == 0.84375
    assert _pattern(compressed_layers=tuple(range(15))).kv_saved_fraction(2048) == 0.421875
    assert _pattern().kv_saved_fraction(200) == 0.0  # shorter than sink + recent: nothing freed
    upstream = _pattern(sink=128, recent=384, compressed_layers=tuple(range(16)))
    assert upstream.kv_saved_fraction(2048) == pytest.approx(0.40)


def _write(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    return path


def test_mismatch_with_the_model_names_each_problem(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    _pattern(compressed_layers=(0, 29)).save(path)
    other = {"num_hidden_layers": 24, "num_key_value_heads": 8, "head_dim": 64}
    with pytest.raises(PatternError) as caught:
        pattern.load(path, config=other, model_id="Qwen/Qwen2.5-0.5B")
    assert isinstance(caught.value, ValueError)
    assert caught.value.problems == [
        "searched on model 'SmolLM2-135M-Instruct', not 'Qwen/Qwen2.5-0.5B'",
        "pattern has 30 layers, model has 24",
        "pattern num_key_value_heads is 3, model num_key_value_heads is 8",
    ]
    assert str(path) in str(caught.value)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"version": 2}, "version must be 1, got 2"),
        ({"format": "other"}, "format must be 'omniinfer.attn.pattern'"),
        ({"compressed_layers": [1, 1]}, "compressed_layers has duplicates: [1, 1]"),
        ({"compressed_layers": [0, 30, -1]}, "compressed_layers [-1, 30] outside 0..29"),
        ({"compressed_layers": "0,1"}, "compressed_layers must be a list of integers"),
        ({"sink": -1}, "sink must be an integer >= 0, got -1"),
        ({"recent": 0}, "recent must be an integer >= 1, got 0"),
        ({"recent": True}, "recent must be an integer >= 1, got True"),
        ({"model": {"num_layers": 30}}, "model must be an object with a string 'id'"),
    ],
)
def test_schema_errors(tmp_path: Path, change: dict, message: str) -> None:
    data = _pattern().to_json() | change
    with pytest.raises(PatternError) as caught:
        pattern.load(_write(tmp_path, data))
    assert len(caught.value.problems) == 1
    assert caught.value.problems[0].startswith(message)


def test_missing_keys_and_unreadable_files(tmp_path: Path) -> None:
    data = _pattern().to_json()
    del data["sink"], data["recent"]
    with pytest.raises(PatternError) as caught:
        pattern.load(_write(tmp_path, data))
    assert caught.value.problems == ["missing key 'sink'", "missing key 'recent'"]
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(PatternError, match="not valid JSON"):
        pattern.load(tmp_path / "bad.json")
    with pytest.raises(PatternError, match="cannot read"):
        pattern.load(tmp_path / "absent.json")
    with pytest.raises(PatternError, match="expected a JSON object"):
        pattern.load(_write(tmp_path, [1, 2]))


def test_constructing_an_invalid_pattern_fails() -> None:
    with pytest.raises(PatternError, match="outside 0..29"):
        _pattern(compressed_layers=(30,))


@pytest.mark.parametrize("path", sorted(
    (Path(pattern.__file__).parent / "patterns").glob("*.json"), key=lambda p: p.name),
    ids=lambda p: p.name)
def test_every_shipped_pattern_loads_and_says_what_it_saves_at_its_context(path: Path) -> None:
    """A server picks a pattern for its traffic's context: each shipped file must load, name
    the context it was searched for, and save there what its provenance says."""
    shipped = pattern.load(path)
    context = shipped.serving_context
    assert context is not None and context > shipped.sink + shipped.recent, path.name
    saved = pattern.kv_saved_fraction(len(shipped.compressed_layers), shipped.num_layers,
                                      shipped.sink, shipped.recent, context)
    assert saved == pytest.approx(shipped.provenance["kv_saved_fraction"], abs=1e-3), path.name


def test_serving_context_is_read_only_when_it_is_a_positive_integer() -> None:
    assert _pattern(provenance={"context": 8192}).serving_context == 8192
    for bad in ({}, {"context": "8192"}, {"context": 0}, {"context": True}):
        assert _pattern(provenance=bad).serving_context is None


@pytest.mark.parametrize("strict_name, full_name, judged", [
    ("smollm2-135m-2k-25.json", "smollm2-135m.json", "judge_2k_front.json"),
    ("smollm2-135m-4k-30.json", "smollm2-135m-4k.json", "judge_4k_front.json"),
])
def test_a_strict_pattern_is_its_full_pattern_less_layers_within_the_bound_it_claims(
        strict_name: str, full_name: str, judged: str) -> None:
    """The strict files ship as the largest saving measured within 1 % on every judged text at
    their context: each must say so, and keep a subset of its full file's layers with the same
    sink, window and context, so a server may move between the two without other changes."""
    folder = Path(pattern.__file__).parent / "patterns"
    strict, full = pattern.load(folder / strict_name), pattern.load(folder / full_name)
    assert set(strict.compressed_layers) < set(full.compressed_layers)
    assert (strict.sink, strict.recent) == (full.sink, full.recent)
    assert strict.serving_context == full.serving_context
    drops = strict.provenance["unseen_drops"]
    assert len(drops) >= 8 and max(drops.values()) <= 0.01
    # what the file claims is what benchmark/attn/judge.py measured for these layers
    results = Path(__file__).resolve().parents[2] / "benchmark/attn/results" / judged
    spec = "layers:" + "+".join(map(str, strict.compressed_layers))
    measured = json.loads(results.read_text())["patterns"][spec]["texts"]
    assert drops == {name: score["drop"] for name, score in measured.items()}
