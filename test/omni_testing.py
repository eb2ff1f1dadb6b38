"""Helpers shared by the test modules (imported as `omni_testing`; conftest holds fixtures)."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def post_json(url: str, body: dict[str, Any], timeout: float = 120.0) -> Any:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def hf_greedy(model_dir: Path, input_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by Hugging Face transformers in float32 (the reference)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([input_ids])
    produced: list[int] = []
    past = None
    with torch.no_grad():
        for _ in range(max_new_tokens):  # plain argmax loop: no EOS handling, no logit processors
            out = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            token = int(out.logits[0, -1].argmax())
            produced.append(token)
            ids = torch.tensor([[token]])
    return produced
