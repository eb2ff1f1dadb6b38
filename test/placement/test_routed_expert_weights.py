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


def test_the_eplb_adapter_publishes_the_descriptor_once_and_keeps_a_published_one() -> None:
    """SGLang's EPLB reads ``model.routed_experts_weights_of_layer``; qwen2_moe has none (the
    first rebalance failed with AttributeError). The manager's wrapped getter returns the model
    with it set, built at call time (after the model loaded); a published one is kept."""
    from omniinfer.sglang_plugin.placement.eplb_adapter import (
        publish_expert_weights,
        with_published_weights,
    )

    qwen2_moe_like = _model([_Moe("l0"), _Moe("l1")])
    calls: list[int] = []

    def get_model() -> object:
        calls.append(1)
        return qwen2_moe_like

    getter = with_published_weights(get_model)
    assert not calls  # nothing is read before a rebalance asks for the model
    model = getter()
    assert model is qwen2_moe_like and calls == [1]
    assert model.routed_experts_weights_of_layer == {0: ["l0.w13", "l0.w2"],
                                                     1: ["l1.w13", "l1.w2"]}
    built = model.routed_experts_weights_of_layer
    assert getter().routed_experts_weights_of_layer is built  # built once
    published = {7: ["own"]}
    qwen3_moe_like = _model([_Moe("x")], routed_experts_weights_of_layer=published)
    assert publish_expert_weights(qwen3_moe_like) is False
    assert qwen3_moe_like.routed_experts_weights_of_layer is published
    with pytest.raises(RuntimeError, match="get_moe_weights"):
        publish_expert_weights(_model([object()]))
