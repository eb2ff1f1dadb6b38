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
SmolLM2's attention (9 heads, 3 KV heads, width 576) does not split over two tensor-parallel
ranks, and qwen2_moe derives the head size from the width. So the folder is widened for
``--tp`` (default 2) with the same function: KV heads are padded to a multiple of tp (3 -> 4,
query heads 9 -> 12, one whole GQA group of zero heads) and the width to heads x head size
(576 -> 768) with zero dimensions that no weight reads or writes. RMSNorm averages over the
wider width, so each norm weight is scaled by sqrt(576/768) and its epsilon by 576/768: the
real dimensions see exactly the dense normalisation, and the padded ones stay zero in every
layer (:func:`widened_shape`, :func:`widen`).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

LICENSE_NOTE = """This folder is derived from SmolLM2-135M-Instruct (Hugging Face TB, Apache-2.0):
each layer's MLP is copied into identical experts behind a router (omniinfer.testbed.models.smollm2_moe).
The weights are the original model's; the licence of the original applies (Apache-2.0).
"""
READS_THE_RESIDUAL = ("embed_tokens.weight", "lm_head.weight", "q_proj.weight", "k_proj.weight",
                      "v_proj.weight", "mlp.gate.weight", "gate_proj.weight", "up_proj.weight")
MOE_ID = "SmolLM2-135M-MoE"
COPIED = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
          "generation_config.json", "special_tokens_map.json")


def widened_shape(dense: dict, tp: int) -> tuple[int, int, int]:
    """(query heads, KV heads, width) of the dense config widened so that ``tp`` ranks split
    the attention: KV heads rounded up to a multiple of ``tp``, query heads in the same GQA
    ratio, the width heads x head size."""
    heads, kv_heads = dense["num_attention_heads"], dense["num_key_value_heads"]
    if tp < 1 or heads % kv_heads:
        raise ValueError("need tp >= 1 and query heads a multiple of KV heads")
    head_dim = dense["hidden_size"] // heads
    wide_kv = -(-kv_heads // tp) * tp
    wide_heads = wide_kv * (heads // kv_heads)
    return wide_heads, wide_kv, wide_heads * head_dim


def moe_config(dense: dict, experts: int, top_k: int, tp: int = 2) -> dict:
    """The Qwen2-MoE config.json for the dense Llama config ``dense``, widened for ``tp``."""
    if dense.get("hidden_size", 0) % dense.get("num_attention_heads", 1):
        raise ValueError("qwen2_moe derives head_dim from hidden_size / heads")
    if dense.get("head_dim", 0) not in (0, dense["hidden_size"] // dense["num_attention_heads"]):
        raise ValueError("the dense model's head_dim differs from hidden_size / heads")
    heads, kv_heads, width = widened_shape(dense, tp)
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
                  torch_dtype=dense.get("dtype", dense.get("torch_dtype", "bfloat16")),
                  num_attention_heads=heads, num_key_value_heads=kv_heads, hidden_size=width,
                  rms_norm_eps=dense["rms_norm_eps"] * dense["hidden_size"] / width)
    return config


def widen(name: str, tensor: Any, width: int, heads: int, kv_heads: int, head_dim: int) -> Any:
    """One tensor of the MoE model widened (see the module docstring): zero rows and columns
    appended where the width or the heads grew, norm weights rescaled."""
    import torch

    if tensor.dim() == 1:  # an RMSNorm weight, kept in float32 so the rescaling rounds nothing
        scaled = tensor.float() * (tensor.shape[0] / width) ** 0.5
        return torch.nn.functional.pad(scaled, (0, width - tensor.shape[0]))
    rows, cols = tensor.shape
    if name.endswith("o_proj.weight"):
        rows, cols = width, heads * head_dim
    elif name.endswith("down_proj.weight"):
        rows = width
    elif name.endswith(READS_THE_RESIDUAL):
        cols = width
        if name.endswith("q_proj.weight"):
            rows = heads * head_dim
        elif name.endswith(("k_proj.weight", "v_proj.weight")):
            rows = kv_heads * head_dim
    else:
        raise ValueError(f"no widening rule for {name}")
    return torch.nn.functional.pad(tensor, (0, cols - tensor.shape[1], 0, rows - tensor.shape[0]))


def moe_pattern(dense: Any, config: dict, model_id: str = MOE_ID) -> Any:
    """The dense model's OmniAttn pattern for the MoE folder with ``config``: the same layers,
    sink and window (the MoE model computes the dense function, so the dense search and its
    perplexity figures hold), the MoE model's id and KV shape (widened KV heads)."""
    from omniinfer.attn.pattern import from_layers

    provenance = {"derived_from": f"{dense.model_id} pattern (omniinfer.testbed.models.smollm2_moe)",
                  "why": "the MoE model computes the dense model's function", **dense.provenance}
    return from_layers(dense.compressed_layers, config, dense.sink, dense.recent, model_id,
                       provenance)


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
            bias_step: float = 0.5, seed: int = 0, tp: int = 2) -> Path:
    """Write the MoE folder (the router calibrated on a public-domain text, the attention
    widened for ``tp`` ranks); returns it."""
    from safetensors.torch import load_file, save_file

    import omniinfer.data

    if not 1 <= top_k <= experts:
        raise ValueError("need 1 <= top_k <= experts")
    dense = json.loads((dense_dir / "config.json").read_text())
    config = moe_config(dense, experts, top_k, tp)
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
    shape = (config["hidden_size"], config["num_attention_heads"],
             config["num_key_value_heads"], dense["hidden_size"] // dense["num_attention_heads"])
    out = {name: widen(name, tensor, *shape) for name, tensor in out.items()}
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
    parser.add_argument("--tp", type=int, default=2,
                        help="widen the attention so that this many ranks split it")
    args = parser.parse_args(argv)
    wanted = moe_config(json.loads((args.dense / "config.json").read_text()), args.experts,
                        args.top_k, args.tp)
    built = args.output / "config.json"
    if built.is_file() and json.loads(built.read_text()) == wanted:
        print(f"already built: {args.output}")
        return 0
    shutil.rmtree(args.output, ignore_errors=True)  # an older build, or another shape
    convert(args.dense, args.output, args.experts, args.top_k, args.bias_step, tp=args.tp)
    print(f"built {args.output} ({args.experts} experts, top {args.top_k})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
