"""The MoE form of SmolLM2: a qwen2_moe config SGLang and transformers read, and a router whose
load is uneven across experts (so placement has work)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omniinfer.testbed.models.smollm2_moe import moe_config, router_weight, widen, widened_shape

ROOT = Path(__file__).resolve().parents[3]
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
    assert parsed.num_experts == 4 and parsed.num_key_value_heads == 4  # 3 widened for tp 2
    assert (parsed.num_attention_heads, parsed.hidden_size) == (12, 768)
    assert parsed.hidden_size // parsed.num_attention_heads == 64  # the dense head size
    assert moe_config(dense, 4, 2, tp=1)["hidden_size"] == 576  # tp 1: nothing widened
    with pytest.raises(ValueError):
        moe_config({**dense, "head_dim": 80}, 4, 2)


def test_widened_shape_keeps_the_gqa_ratio_and_head_size() -> None:
    dense = {"num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
    assert widened_shape(dense, 1) == (9, 3, 576)
    assert widened_shape(dense, 2) == (12, 4, 768)
    assert widened_shape(dense, 4) == (12, 4, 768)
    assert widened_shape(dense, 3) == (9, 3, 576)
    with pytest.raises(ValueError):
        widened_shape({**dense, "num_key_value_heads": 2}, 2)


def test_widened_model_computes_the_dense_function() -> None:
    """A random Llama of SmolLM2's head layout, widened for tp 2: same logits (float32)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    base = dict(vocab_size=97, intermediate_size=40, num_hidden_layers=3, rms_norm_eps=1e-5,
                max_position_embeddings=64, tie_word_embeddings=False)
    dense = LlamaForCausalLM(LlamaConfig(**base, hidden_size=72, num_attention_heads=9,
                                         num_key_value_heads=3)).eval()
    for p in dense.parameters():  # norms away from 1, so a wrong rescaling shows
        torch.nn.init.normal_(p, 1.0 if p.dim() == 1 else 0.0, 0.3 if p.dim() == 1 else 0.2)
    heads, kv_heads, width = widened_shape(dense.config.to_dict(), 2)
    wide = LlamaForCausalLM(LlamaConfig(**{**base, "rms_norm_eps": 1e-5 * 72 / width},
                                        hidden_size=width, num_attention_heads=heads,
                                        num_key_value_heads=kv_heads, head_dim=8)).eval()
    state = {name: widen(name, t, width, heads, kv_heads, 8)
             for name, t in dense.state_dict().items()}
    wide.load_state_dict(state)
    ids = torch.randint(0, 97, (2, 17))
    with torch.no_grad():
        want, got = dense(input_ids=ids).logits, wide(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()
    broken = dict(state)  # the check can fail: forget the norm rescaling in one layer
    broken["model.layers.1.input_layernorm.weight"] = torch.nn.functional.pad(
        dense.state_dict()["model.layers.1.input_layernorm.weight"], (0, width - 72))
    wide.load_state_dict(broken)
    with torch.no_grad():
        assert not torch.allclose(wide(input_ids=ids).logits, want, atol=1e-3)


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
        for e in range(4):  # widened from 576 to 768 columns with zeros
            up = moe.get_tensor(f"model.layers.7.mlp.experts.{e}.up_proj.weight")
            assert up[:, :576].equal(dense.get_tensor("model.layers.7.mlp.up_proj.weight"))
            assert not up[:, 576:].any()
        head = moe.get_tensor("lm_head.weight")
        assert head[:, :576].equal(dense.get_tensor("model.embed_tokens.weight"))
        assert moe.get_tensor("model.layers.7.self_attn.k_proj.weight").shape == (256, 768)
    assert (MOE / "LICENSE-NOTE.txt").is_file()


def test_shipped_moe_pattern_is_the_dense_pattern_for_the_moe_shape() -> None:
    """patterns/smollm2-135m-moe.json is what ``moe_pattern`` derives from the dense pattern
    (so the two cannot drift apart), and it fits the MoE config."""
    from omniinfer.attn.pattern import check_model, load
    from omniinfer.testbed.models.smollm2_moe import MOE_ID, moe_pattern

    patterns = ROOT / "python" / "omniinfer" / "attn" / "patterns"
    config = moe_config(json.loads((DENSE / "config.json").read_text()), 4, 2)
    dense = load(patterns / "smollm2-135m.json")
    shipped = load(patterns / "smollm2-135m-moe.json")
    assert shipped == moe_pattern(dense, config)
    assert shipped.compressed_layers == dense.compressed_layers
    assert check_model(shipped, config, MOE_ID) == []
    assert check_model(dense, config, MOE_ID)  # the dense file does not fit the MoE model
