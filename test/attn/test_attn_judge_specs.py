"""benchmark/attn/judge.py's pattern specs and generalise.py's transfer seeds, without a model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark" / "attn"))

import generalise  # noqa: E402
import judge  # noqa: E402

from omniinfer.attn.objective import from_layers, to_bits  # noqa: E402


def test_a_layer_list_names_exactly_those_layers() -> None:
    genome, loaded = judge.resolve("layers:0+3+29", 30)
    assert loaded is None and [i for i, b in enumerate(genome) if b] == [0, 3, 29]
    assert sum(judge.resolve("first-4", 30)[0][:4]) == 4


@pytest.mark.parametrize("spec", ["layers:", "layers:1+x", "layers:30", "layers:-1"])
def test_a_bad_layer_list_stops_with_its_reason(spec: str) -> None:
    with pytest.raises(SystemExit, match="layer ids"):
        judge.resolve(spec, 30)


def test_transfer_seeds_prefer_the_layers_another_search_found_cheap(tmp_path: Path) -> None:
    cheap = [0, 1, 2, 3]  # every scored pattern costs one point per layer outside these
    records = {}
    for layers in ([0, 1, 4, 5], [2, 3, 6, 7], [0, 2, 5, 8], [1, 3, 4, 9], [0, 3, 6, 9],
                   [1, 2, 7, 8], [4, 5, 6, 7], [6, 7, 8, 9], [0, 1, 2, 9], [3, 5, 7, 9]):
        cost = sum(1 for i in layers if i not in cheap) / 100
        records[to_bits(from_layers(layers, 10))] = {"texts": {"a": {"drop": cost},
                                                               "b": {"drop": cost}}}
    cache = tmp_path / "search.json"
    cache.write_text(json.dumps(records))
    seeds = generalise.transfer_seeds(cache, ["a", "b"], 5, 2, 1e-6, 0)
    assert len(seeds) == 2 and len(set(seeds)) == 2
    assert all(s.count("1") == 5 and s[:4] == "1111" for s in seeds)
    with pytest.raises(SystemExit, match="search texts"):
        generalise.transfer_seeds(cache, ["a", "c"], 5, 2, 0.3, 0)


def test_pattern_seeds_are_the_files_layers_and_a_wrong_size_is_refused() -> None:
    folder = Path(generalise.__file__).resolve().parents[2] / "python/omniinfer/attn/patterns"
    full, strict = folder / "smollm2-135m.json", folder / "smollm2-135m-2k-25.json"
    layers = json.loads(full.read_text())["compressed_layers"]
    assert generalise.pattern_seeds(f"{full},", 16, 30) == [to_bits(from_layers(layers, 30))]
    assert generalise.pattern_seeds("", 16, 30) == []
    with pytest.raises(SystemExit, match="compresses 10 layers; the search holds 16"):
        generalise.pattern_seeds(f"{full},{strict}", 16, 30)
