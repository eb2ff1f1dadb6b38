"""Fixtures of the SmolLM2 real-server tests: the model folder, its evaluator model, the pattern."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from attn_serving import RECENT, SINK, saved_pattern

from omniinfer.attn import evaluator
from omniinfer.attn.pattern import Pattern


@pytest.fixture(scope="module")
def model_dir() -> Path:
    path = evaluator.DEFAULT_MODEL
    assert path.is_dir(), f"SmolLM2 is expected at {path}"
    return path


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Any:
    """The evaluator's (masked) model, loaded once per module."""
    model, _ = evaluator.load_model(model_dir)
    return model


@pytest.fixture(scope="module")
def pattern(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Pattern, Path]:
    """Every other layer compressed (the first one included) to SINK + RECENT, and its file."""
    from transformers import AutoConfig

    layers = AutoConfig.from_pretrained(model_dir).num_hidden_layers
    return saved_pattern(model_dir, range(0, layers, 2), SINK, RECENT,
                         tmp_path_factory.mktemp("attn-pattern"))
