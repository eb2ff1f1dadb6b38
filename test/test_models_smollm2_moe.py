"""The MoE form of SmolLM2: a qwen2_moe config SGLang and transformers read, and a router whose
load is uneven across experts (so placement has work)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omniinfer.models.smollm2_moe import moe_config, router_weight

ROOT = Path(__file__).resolve().parents[1]
DENSE = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"
MOE = ROOT / ".cache" / "models" / "SmolLM2-135M-MoE"


def test_config_is_llama_attention_in_qwen2_moe_form() -> None:
    from transformers import AutoConfig

    dense = json.loads((DENSE / "config.json").read_text())
    config = moe_config(dense, experts=4, top_k=2)
    assert config["qkv_bias"] is False and config["shared_expert_intermediate_size"] == 0
    assert config["norm_topk_prob"] is True and config["moe_intermediate_size"] == 1536
    parsed = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "model_type"},
                                  model_type="qwen2_moe")
    assert parsed.num_experts == 4 and parsed.num_key_value_heads == 3
    with pytest.raises(ValueError):
        moe_config({**dense, "head_dim": 80}, 4, 2)


def test_router_load_is_token_dependent_and_skewed() -> None:
    import torch

    mean = torch.randn(576) * 0.5
    weight = router_weight(mean, 1.0, 4, layer=3)
    tokens = mean + torch.randn(4096, 576)
    top = (tokens @ weight.T).softmax(-1).topk(2).indices
    load = torch.bincount(top.flatten(), minlength=4).float()
    assert load[0] > load[3] * 1.5  # uneven: placement has work
    assert (load > 0).all()  # but every expert is used, token by token
    assert torch.equal(weight, router_weight(mean, 1.0, 4, layer=3))


def test_built_folder_matches_the_dense_weights() -> None:
    from safetensors import safe_open

    if not (MOE / "config.json").is_file():
        pytest.fail(f"{MOE} is missing: scripts/setup.sh builds it")
    with safe_open(str(MOE / "model.safetensors"), "pt") as moe, \
            safe_open(str(DENSE / "model.safetensors"), "pt") as dense:
        for e in range(4):
            assert moe.get_tensor(f"model.layers.7.mlp.experts.{e}.up_proj.weight").equal(
                dense.get_tensor("model.layers.7.mlp.up_proj.weight"))
        assert moe.get_tensor("lm_head.weight").equal(
            dense.get_tensor("model.embed_tokens.weight"))
    assert (MOE / "LICENSE-NOTE.txt").is_file()
