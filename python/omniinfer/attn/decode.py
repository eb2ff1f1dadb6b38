"""Reference decoding with a KV cache that really drops evicted tokens in compressed layers.

This is what a serving runtime does: feed one token at a time, and after each step cut every
compressed layer's cache down to its first ``sink`` tokens and its last ``recent - 1`` ones (the
next token makes ``recent``). Attention then runs unmasked over whatever the cache holds, with
transformers' stock SDPA attention. The masked evaluator must give the same logits; the tests
check that, and the runtime can compare its greedy outputs against :func:`greedy`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from omniinfer.attn.masks import Windows


def evict(cache: Any, compressed: Sequence[bool], sink: int, recent: int) -> None:
    """Drop, in place, the KV entries compressed layers no longer keep."""
    keep_recent = recent - 1
    for layer, is_compressed in zip(cache.layers, compressed, strict=True):
        if not is_compressed or layer.keys is None or layer.keys.shape[-2] <= sink + keep_recent:
            continue
        tail = layer.keys.shape[-2] - keep_recent
        layer.keys = torch.cat([layer.keys[..., :sink, :], layer.keys[..., tail:, :]], dim=-2)
        layer.values = torch.cat(
            [layer.values[..., :sink, :], layer.values[..., tail:, :]], dim=-2
        )


def cached_lengths(cache: Any) -> list[int]:
    return [0 if layer.keys is None else int(layer.keys.shape[-2]) for layer in cache.layers]


class _Evicting:
    """A model fed one token at a time whose cache is cut after every step, as a runtime's is."""

    def __init__(self, model: Any, compressed: Sequence[bool], sink: int, recent: int) -> None:
        from transformers import DynamicCache

        self.model, self.compressed, self.sink, self.recent = model, compressed, sink, recent
        self.cache = DynamicCache(config=model.config)

    def feed(self, token: int, position: int) -> torch.Tensor:
        """The next-token logits after ``token`` at ``position``; then the cache is cut."""
        out = self.model(
            input_ids=torch.tensor([[token]]),
            position_ids=torch.tensor([[position]]),  # caches differ in length per layer
            past_key_values=self.cache,
            use_cache=True,
        )
        evict(self.cache, self.compressed, self.sink, self.recent)
        return out.logits[0, -1].float()


def step_logits(
    model: Any, input_ids: Sequence[int], compressed: Sequence[bool], sink: int, recent: int
) -> tuple[torch.Tensor, list[int]]:
    """Logits [T, vocab] from token-by-token decoding with eviction, and the final cache
    lengths per layer. The model must use a stock attention ("sdpa" or "eager")."""
    run = _Evicting(model, compressed, sink, recent)
    with torch.inference_mode():
        rows = [run.feed(token, position) for position, token in enumerate(input_ids)]
    return torch.stack(rows), cached_lengths(run.cache)


def greedy(
    model: Any,
    prompt: Sequence[int],
    new_tokens: int,
    compressed: Sequence[bool],
    sink: int,
    recent: int,
) -> list[int]:
    """Greedy continuation of ``prompt`` with a really evicting cache (stock attention)."""
    run = _Evicting(model, compressed, sink, recent)
    ids = list(prompt)
    with torch.inference_mode():
        for position, token in enumerate(ids):
            logits = run.feed(token, position)
        for _ in range(new_tokens):
            ids.append(int(logits.argmax()))
            logits = run.feed(ids[-1], len(ids) - 1)
    return ids[len(prompt) :]


def masked_greedy(
    model: Any, prompt: Sequence[int], new_tokens: int, windows: Windows | None
) -> list[int]:
    """The same continuation from the masked evaluator: every layer's (sink, recent) window of
    ``windows`` masked, over a cache that keeps every token (None: the full model). The model
    must use :func:`omniinfer.attn.masks.use`. The runtime's reference."""
    from transformers import DynamicCache

    cache, produced, step = DynamicCache(config=model.config), [], torch.tensor([list(prompt)])
    with torch.inference_mode():
        for _ in range(new_tokens):
            logits = model(input_ids=step, past_key_values=cache, use_cache=True,
                           omni_windows=windows).logits[0, -1]
            produced.append(int(logits.argmax()))
            step = torch.tensor([[produced[-1]]])
    return produced
