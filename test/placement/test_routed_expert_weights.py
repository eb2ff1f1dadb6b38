"""Which expert weights the placement runtime migrates: the model's published EPLB descriptor,
or (qwen2_moe publishes none) each MoE layer's ``mlp.get_moe_weights()``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from omniinfer.sglang_plugin.placement.runtime import routed_expert_weights


class _Moe:
    def __init__(self, tag: str) -> None:
        self.tag = tag

    def get_moe_weights(self) -> list[str]:
        return [f"{self.tag}.w13", f"{self.tag}.w2"]


def _model(mlps: list[object], start: int = 0, end: int | None = None, **extra: object) -> object:
    layers = [SimpleNamespace(mlp=m) for m in mlps]
    inner = SimpleNamespace(layers=layers, start_layer=start,
                            end_layer=len(layers) if end is None else end)
    return SimpleNamespace(model=inner, **extra)


def test_published_descriptor_wins() -> None:
    published = {3: ["x"]}
    assert routed_expert_weights(_model([_Moe("a")],
                                        routed_experts_weights_of_layer=published)) is published


def test_built_from_moe_layers_of_this_rank_only() -> None:
    model = _model([object(), _Moe("l1"), _Moe("l2"), _Moe("l3")], start=1, end=3)
    assert routed_expert_weights(model) == {1: ["l1.w13", "l1.w2"], 2: ["l2.w13", "l2.w2"]}


def test_a_model_without_expert_weights_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="get_moe_weights"):
        routed_expert_weights(_model([object(), object()]))
    with pytest.raises(RuntimeError, match="no routed expert weights"):
        routed_expert_weights(SimpleNamespace())
