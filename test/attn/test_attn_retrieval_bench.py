"""The retrieval benchmark's conditions and summaries (the model runs are the benchmark's)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark" / "attn"))

import retrieval  # noqa: E402

from omniinfer.attn.passkey import PasskeyCase  # noqa: E402
from omniinfer.attn.pattern import Pattern  # noqa: E402


def _pattern(layers: tuple[int, ...]) -> Pattern:
    return Pattern(model_id="m", num_layers=6, sink=4, recent=8, compressed_layers=layers,
                   model_shape={})


def test_each_pattern_gets_a_first_k_twin_of_its_size() -> None:
    found = retrieval.conditions([_pattern((1, 4, 5))], ["p"])
    assert list(found) == ["none", "p", "first-3 (4+8)"]
    assert found["none"] is None
    assert found["p"] == (None, (4, 8), None, None, (4, 8), (4, 8))
    assert found["first-3 (4+8)"] == ((4, 8), (4, 8), (4, 8), None, None, None)


def test_summary_by_depth() -> None:
    cases = [PasskeyCase((1,), 0, d, "k") for d in (0.1, 0.1, 0.5, 0.5)]
    out = retrieval.summarise(cases, [True, False, True, True])
    assert out["accuracy"] == 0.75 and out["cases"] == 4
    assert out["by_depth"] == {"0.1": 0.5, "0.5": 1.0}
