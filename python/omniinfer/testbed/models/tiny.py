"""Tiny random Llama, Qwen3 and Qwen3-MoE models with a locally trained tokenizer, for tests.

Deterministic: the same seed gives the same tokenizer and the same weights, so a test can
compare SGLang against Hugging Face transformers on identical checkpoints. Built in seconds.
"""

from __future__ import annotations

import argparse
from importlib import resources
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VOCAB_SIZE = 1024
CORPUS_CHARS = 200_000

COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=4096,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
    tie_word_embeddings=False,
)
ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "qwen3": ("qwen3", {}),
    "qwen3_moe": (
        "qwen3_moe",
        dict(
            moe_intermediate_size=64,
            num_experts=8,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            norm_topk_prob=True,
            mlp_only_layers=[],
        ),
    ),
}


def training_text() -> str:
    """Public-domain text shipped with the package (Shakespeare), trimmed for speed."""
    source = resources.files("omniinfer.data").joinpath("text/tinyshakespeare.txt")
    return source.read_text(encoding="utf-8")[:CORPUS_CHARS]


def train_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([training_text()], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=SPECIAL_TOKENS[0],
        eos_token=SPECIAL_TOKENS[0],
        unk_token=SPECIAL_TOKENS[0],
        pad_token=SPECIAL_TOKENS[0],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build(
    arch: str, output: Path, seed: int = 0, tokenizer: Any = None, **overrides: Any
) -> Path:
    """Write a tiny random model of ``arch`` ("llama", "qwen3" or "qwen3_moe") to ``output``.

    ``overrides`` change config fields (e.g. a larger MoE for benchmarks).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose from {sorted(ARCHITECTURES)}")
    model_type, extra = ARCHITECTURES[arch]
    config = AutoConfig.for_model(model_type, **{**COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(output)
    (tokenizer or train_tokenizer()).save_pretrained(output)
    return output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--arch", choices=sorted(ARCHITECTURES), default="llama")
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    build(args.arch, args.output, args.seed)
    print(f"wrote tiny {args.arch} to {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
