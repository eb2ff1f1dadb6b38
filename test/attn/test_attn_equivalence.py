"""The masked one-pass evaluator equals decoding with a KV cache that really evicts tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.nn import functional as F
from transformers import AutoModelForCausalLM

from omniinfer.attn import decode, masks

SINK, RECENT, LENGTH = 4, 8, 56


def _model(path: Path, implementation: str) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.set_attn_implementation(implementation)
    return model


def _masked_logits(model: torch.nn.Module, ids: list[int], compressed: tuple[bool, ...]):
    windows = masks.windows_for(compressed, SINK, RECENT)
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids]), omni_windows=windows).logits[0]


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("compressed", [(True, False), (False, True), (True, True)])
def test_masked_pass_equals_decoding_with_evicted_kv(
    tiny_models: dict[str, Path], arch: str, compressed: tuple[bool, ...],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(masks, "BLOCK", 16)  # several query blocks in the compressed layers
    ids = torch.randint(3, 1000, (LENGTH,), generator=torch.Generator().manual_seed(1)).tolist()

    stock = _model(tiny_models[arch], "sdpa")
    evicted, lengths = decode.step_logits(stock, ids, compressed, SINK, RECENT)
    with torch.inference_mode():
        full = stock(input_ids=torch.tensor([ids])).logits[0]

    masked_model = _model(tiny_models[arch], "sdpa")
    masks.use(masked_model)
    masked = _masked_logits(masked_model, ids, compressed)

    # The cache really dropped the tokens: compressed layers hold sink + recent - 1 entries.
    assert lengths == [SINK + RECENT - 1 if c else LENGTH for c in compressed]
    torch.testing.assert_close(masked, evicted, rtol=1e-4, atol=1e-4)
    # Before any eviction everything equals the full model; after it, it must not.
    torch.testing.assert_close(masked[: SINK + RECENT], full[: SINK + RECENT], rtol=1e-4, atol=1e-4)
    assert (masked[SINK + RECENT :] - full[SINK + RECENT :]).abs().max() > 1e-3


def test_full_pattern_equals_the_stock_model(tiny_models: dict[str, Path]) -> None:
    ids = list(range(5, 5 + LENGTH))
    stock = _model(tiny_models["llama"], "sdpa")
    with torch.inference_mode():
        full = stock(input_ids=torch.tensor([ids])).logits[0]
    masks.use(stock)
    torch.testing.assert_close(_masked_logits(stock, ids, (False, False)), full)


@pytest.mark.parametrize(
    ("q_len", "k_len", "sink", "recent", "block"),
    [(40, 40, 4, 8, 16), (40, 40, 0, 5, 7), (10, 40, 4, 8, 4), (6, 6, 8, 3, 4), (33, 33, 2, 64, 8)],
)
def test_blocked_window_attention_matches_a_dense_mask(
    q_len: int, k_len: int, sink: int, recent: int, block: int
) -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, q_len, 8, generator=g)
    k, v = torch.randn(1, 2, k_len, 8, generator=g), torch.randn(1, 2, k_len, 8, generator=g)
    got = masks.sink_recent_attention(q, k, v, sink, recent, None, block=block)
    mask = masks.window_mask(torch.arange(k_len - q_len, k_len), torch.arange(k_len), sink, recent)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(got, want)


def test_window_mask_is_sink_plus_recent() -> None:
    mask = masks.window_mask(torch.arange(10), torch.arange(10), 2, 3)
    assert mask[9].nonzero().flatten().tolist() == [0, 1, 7, 8, 9]
    assert mask[3].nonzero().flatten().tolist() == [0, 1, 2, 3]
    assert not mask.triu(1).any()


def test_greedy_with_eviction_equals_masked_greedy(tiny_models: dict[str, Path]) -> None:
    prompt = torch.randint(3, 1000, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    stock = _model(tiny_models["llama"], "sdpa")
    evicting = decode.greedy(stock, prompt, 12, (True, False), SINK, RECENT)
    masked_model = _model(tiny_models["llama"], "sdpa")
    masks.use(masked_model)
    assert decode.masked_greedy(masked_model, prompt, 12,
                                masks.windows_for((True, False), SINK, RECENT)) == evicting
    assert len(evicting) == 12
