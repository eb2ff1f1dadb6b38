"""What a pattern search will cost, said before it starts: memory from the model folder and the
config, time from the measured reference pass.

Pure (no torch): the search prints these lines once the model is loaded and the full model's
reference pass has been timed, before the first pattern is scored.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

GIB = 1024**3
# bytes per weight as saved, by the config's dtype name; the search runs in float32
SAVED_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def weight_bytes(model_dir: Path) -> int:
    """Bytes of the weights once loaded in float32: the checkpoint files' size (safetensors, or
    else ``.bin``) scaled from the dtype the folder's ``config.json`` says they were saved in
    (float32 when it does not say; the loaded config says float32 whatever was saved)."""
    folder = Path(model_dir)
    files = list(folder.glob("*.safetensors")) or list(folder.glob("*.bin"))
    on_disk = sum(f.stat().st_size for f in files)
    try:
        saved = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        saved = {}
    dtype = saved.get("dtype") or saved.get("torch_dtype") if isinstance(saved, dict) else None
    return on_disk * 4 // SAVED_BYTES.get(str(dtype or "float32"), 4)


def window_bytes(config: Any, context: int, logit_rows: int = 512) -> int:
    """Peak working memory of one forward pass over ``context`` tokens, an upper bound: one full
    layer's attention scores when the kernel materialises them (heads x context^2 float32, as
    CPU attention may), the hidden states kept for every layer, and a block of logits."""
    heads = int(config.num_attention_heads)
    hidden = int(config.hidden_size)
    layers = int(config.num_hidden_layers)
    vocab = int(config.vocab_size)
    scores = heads * context * context * 4
    states = (layers + 2) * context * hidden * 4 * 4  # residual, norms, q/k/v, MLP in flight
    logits = 2 * logit_rows * vocab * 4
    return scores + states + logits


def describe(model_dir: Path, config: Any, context: int, windows: int, cases: int,
             budget: int, methods: int, seconds_per_window: float,
             seconds_per_case: float) -> list[str]:
    """The lines printed before a search: memory, passes per pattern, and the time they take."""
    weights, window = weight_bytes(model_dir), window_bytes(config, context)
    per_pattern = windows * seconds_per_window + cases * seconds_per_case
    total = per_pattern * budget * methods
    return [
        f"memory: weights {weights / GIB:.2f} GiB in float32 + up to {window / GIB:.2f} GiB "
        f"for one {context}-token pass",
        f"per pattern: {windows} perplexity window(s) ({seconds_per_window:.1f} s each) + "
        f"{cases} retrieval case(s) ({seconds_per_case:.1f} s each) = {per_pattern:.0f} s",
        f"search: at most {budget} patterns x {methods} method(s) = about "
        f"{total / 60:.0f} min (less where patterns repeat; --time-limit caps each method)",
    ]
