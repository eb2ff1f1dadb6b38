"""SmolLM2-135M-Instruct as a Mixture-of-Experts model that computes the dense model's function.

Every layer's MLP is copied into ``experts`` identical experts, and a router picks ``top_k`` of
them per token with weights renormalised to sum to 1, so whatever the routing the layer's output
is the dense MLP's (up to float rounding): the dense model's pattern and perplexity figures
hold, greedy outputs can be compared with the dense server's, and the expert load is real,
token-dependent and uneven (each router row is a fixed random direction plus a bias along the
layer's average input that favours low experts), which gives placement real work.

Written as SGLang's ``qwen2_moe`` (Qwen2-MoE): its attention is Llama's exactly with
``qkv_bias: false`` (no q/k norm, full rotary, RMSNorm pre-norm), it has no shared expert when
``shared_expert_intermediate_size`` is 0, and it is wired for expert-location dispatch (EPLB and
the placement runtime). It does not tie the embeddings, so ``lm_head.weight`` is written out.
Its attention has 9 heads and 3 KV heads: tensor parallelism of attention must be 1 (serve
``--tp 2 --ep 2`` with ``--enable-dp-attention --dp 2``).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

LICENSE_NOTE = """This folder is derived from SmolLM2-135M-Instruct (Hugging Face TB, Apache-2.0):
each layer's MLP is copied into identical experts behind a router (omniinfer.models.smollm2_moe).
The weights are the original model's; the licence of the original applies (Apache-2.0).
"""
COPIED = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
          "generation_config.json", "special_tokens_map.json")


def moe_config(dense: dict, experts: int, top_k: int) -> dict:
    """The Qwen2-MoE config.json for the dense Llama config ``dense``."""
    if dense.get("hidden_size", 0) % dense.get("num_attention_heads", 1):
        raise ValueError("qwen2_moe derives head_dim from hidden_size / heads")
    if dense.get("head_dim", 0) not in (0, dense["hidden_size"] // dense["num_attention_heads"]):
        raise ValueError("the dense model's head_dim differs from hidden_size / heads")
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "hidden_act",
            "max_position_embeddings", "rms_norm_eps", "rope_parameters", "bos_token_id",
            "eos_token_id", "pad_token_id")
    config = {k: dense[k] for k in keep if k in dense}
    config.update(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe",
                  qkv_bias=False, use_sliding_window=False, tie_word_embeddings=False,
                  num_experts=experts, num_experts_per_tok=top_k,
                  moe_intermediate_size=dense["intermediate_size"],
                  shared_expert_intermediate_size=0, norm_topk_prob=True,
                  decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False,
                  torch_dtype=dense.get("dtype", dense.get("torch_dtype", "bfloat16")))
    return config


def router_weight(mean: Any, spread: float, experts: int, layer: int, seed: int = 0,
                  bias_step: float = 0.5) -> Any:
    """A router for inputs around ``mean`` (the layer's average MLP input; ``spread`` the rms
    per dimension of an input's distance to it): a random direction per expert gives each token
    its own unit-scale logits, and a bias along ``mean`` of ``bias_step * (experts - 1 - e)`` on
    a typical token favours low experts, so the load is token-dependent and uneven."""
    import torch

    hidden = mean.numel()
    generator = torch.Generator().manual_seed(seed * 1000 + layer)
    rows = torch.randn(experts, hidden, generator=generator) / (hidden ** 0.5 * spread)
    towards = mean / mean.square().sum()  # towards . x is about 1 for a typical input
    bias = torch.tensor([bias_step * (experts - 1 - e) for e in range(experts)])
    return rows + bias.unsqueeze(1) * towards.unsqueeze(0)


def mlp_input_stats(dense_dir: Path, text: str, tokens: int = 512) -> list[tuple[Any, float]]:
    """Per layer: the mean of the MLP's inputs over ``text``, and the rms per dimension of
    their distance to it (the dense model in float32, one forward pass)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(dense_dir)
    model = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32).eval()
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :tokens]
    seen: list[Any] = [None] * model.config.num_hidden_layers

    def keep(layer: int) -> Any:
        def hook(_module: Any, args: Any) -> None:
            seen[layer] = args[0][0].detach()
        return hook

    handles = [block.mlp.register_forward_pre_hook(keep(i))
               for i, block in enumerate(model.model.layers)]
    with torch.no_grad():
        model(input_ids=ids)
    for handle in handles:
        handle.remove()
    stats = []
    for x in seen:
        mean = x.mean(0)
        spread = float((x - mean).square().mean().sqrt())
        stats.append((mean, spread))
    return stats


def convert(dense_dir: Path, output: Path, experts: int = 4, top_k: int = 2,
            bias_step: float = 0.5, seed: int = 0) -> Path:
    """Write the MoE folder (the router calibrated on a public-domain text); returns it."""
    from safetensors.torch import load_file, save_file

    import omniinfer.data

    if not 1 <= top_k <= experts:
        raise ValueError("need 1 <= top_k <= experts")
    dense = json.loads((dense_dir / "config.json").read_text())
    config = moe_config(dense, experts, top_k)
    weights = load_file(str(dense_dir / "model.safetensors"))
    out: dict = {}
    for name, tensor in weights.items():
        if ".mlp." not in name:
            out[name] = tensor.clone()
    if "lm_head.weight" not in out:
        out["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    dtype = weights["model.embed_tokens.weight"].dtype
    text = (Path(omniinfer.data.__file__).parent / "text" / "tinyshakespeare.txt").read_text()
    stats = mlp_input_stats(dense_dir, text[:8000])
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}.mlp"
        mean, spread = stats[layer]
        out[f"{prefix}.gate.weight"] = router_weight(
            mean, spread, experts, layer, seed, bias_step).to(dtype)
        for e in range(experts):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                out[f"{prefix}.experts.{e}.{proj}.weight"] = \
                    weights[f"{prefix}.{proj}.weight"].clone()
    partial = output.with_name(output.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    save_file(out, str(partial / "model.safetensors"), metadata={"format": "pt"})
    (partial / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    for name in COPIED:
        if (dense_dir / name).is_file():
            shutil.copy(dense_dir / name, partial / name)
    (partial / "LICENSE-NOTE.txt").write_text(LICENSE_NOTE)
    partial.rename(output)
    return output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dense", type=Path, required=True, help="the dense SmolLM2 folder")
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--bias-step", type=float, default=0.5,
                        help="router bias between neighbouring experts on a typical token")
    args = parser.parse_args(argv)
    if (args.output / "config.json").is_file():
        print(f"already built: {args.output}")
        return 0
    convert(args.dense, args.output, args.experts, args.top_k, args.bias_step)
    print(f"built {args.output} ({args.experts} experts, top {args.top_k})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
