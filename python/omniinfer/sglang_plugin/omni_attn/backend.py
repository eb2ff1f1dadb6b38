"""Sink + recent attention for compressed layers on SGLang's ``torch_native`` backend.

SGLang's hybrid pool keeps compressed layers in the SWA sub-pool, addressed by SWA slot ids,
while ``req_to_token`` holds full-pool ids. The stock torch_native backend indexes every layer's
buffer with full ids and masks with a plain window, so compressed layers are served here: the
keys each request may read (:func:`omniinfer.attn.runtime_window.key_span`) are gathered
through the full-to-SWA map, and the queries attend with the evaluator's own mask
(:func:`omniinfer.attn.masks.window_mask`). A key whose slot was already freed maps to the
padding slot 0; reading one is a bug in the freeing, so it raises instead of computing noise.
Full layers go to the stock code unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.nn.functional import scaled_dot_product_attention

from omniinfer.attn.masks import window_mask
from omniinfer.attn.runtime_window import key_span


class EvictedKeyRead(RuntimeError):
    """A compressed layer was about to read a key whose KV slot had been freed."""


class CompressedAttention:
    """Serves the compressed layers of one server (one instance per scheduler process)."""

    def __init__(self, compressed_layers: Sequence[int], sink: int, recent: int) -> None:
        self.compressed = frozenset(compressed_layers)
        self.sink, self.recent = sink, recent
        self.keys_read = 0  # keys gathered by compressed layers (status: work skipped)
        self.keys_full = 0  # keys full attention would have read in the same calls

    def handles(self, backend: Any, layer: Any) -> bool:
        pool = backend.token_to_kv_pool
        return (
            layer.layer_id in self.compressed
            and not layer.is_cross_attention
            and hasattr(pool, "translate_loc_from_full_to_swa")
        )

    def forward(self, backend: Any, q: Any, k: Any, v: Any, layer: Any, batch: Any,
                save_kv_cache: bool, decode: bool) -> torch.Tensor:
        if layer.logit_cap and layer.logit_cap > 0:
            raise NotImplementedError("OmniAttn compressed layers: logit capping is unsupported")
        pool = backend.token_to_kv_pool
        if save_kv_cache and k is not None and v is not None:
            from sglang.srt.mem_cache.memory_pool import KVWriteLoc

            loc = KVWriteLoc(batch.out_cache_loc, backend.swa_out_cache_loc)
            pool.set_kv_buffer(layer, loc, k, v)
        heads, dim, v_dim = layer.tp_q_head_num, layer.qk_head_dim, layer.v_head_dim
        query = q.reshape(-1, heads, dim)
        out = query.new_empty((query.shape[0], heads, v_dim))
        seq_lens = batch.seq_lens.tolist()
        if decode:
            prefix_lens, q_lens = [s - 1 for s in seq_lens], [1] * len(seq_lens)
        else:
            prefix_lens = batch.extend_prefix_lens.tolist()
            q_lens = batch.extend_seq_lens.tolist()
        key_buf = pool.get_key_buffer(layer.layer_id)
        value_buf = pool.get_value_buffer(layer.layer_id)
        rows = backend.req_to_token_pool.req_to_token
        start = 0
        for i, (prefix, q_len, seq_len) in enumerate(zip(prefix_lens, q_lens, seq_lens,
                                                         strict=True)):
            stop = start + q_len
            out[start:stop] = self._one_request(
                query[start:stop], rows[batch.req_pool_indices[i]], key_buf, value_buf, pool,
                prefix, seq_len, layer,
            )
            start = stop
        return out.reshape(-1, heads * v_dim)

    def _one_request(self, query: torch.Tensor, row: torch.Tensor, key_buf: torch.Tensor,
                     value_buf: torch.Tensor, pool: Any, prefix: int, seq_len: int,
                     layer: Any) -> torch.Tensor:
        span = key_span(prefix, seq_len, self.sink, self.recent)
        k_pos = torch.tensor(span.positions(), dtype=torch.int64, device=row.device)
        swa_slots = pool.translate_loc_from_full_to_swa(row[k_pos].to(torch.int64))
        if bool((swa_slots <= 0).any()):
            lost = k_pos[swa_slots <= 0].tolist()
            raise EvictedKeyRead(
                f"layer {layer.layer_id}: {len(lost)} keys at positions {lost[:5]} .. "
                f"{lost[-1]} were freed (prefix {prefix}, seq_len {seq_len})"
            )
        keys = key_buf[swa_slots].movedim(0, 1).to(query.dtype)  # [kv_heads, n, dim]
        values = value_buf[swa_slots].movedim(0, 1).to(query.dtype)
        q_pos = torch.arange(prefix, seq_len, device=row.device)
        mask = window_mask(q_pos, k_pos, self.sink, self.recent)
        self.keys_read += int(mask.sum())
        self.keys_full += int((q_pos + 1).sum())
        result = scaled_dot_product_attention(
            query.movedim(0, 1).unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
            attn_mask=mask, scale=layer.scaling,
            enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num,
        )
        return result.squeeze(0).movedim(0, 1)


def around_forward(attention: CompressedAttention, decode: bool) -> Callable[..., Any]:
    """AROUND hook for ``TorchNativeAttnBackend.forward_extend`` / ``forward_decode``."""

    def hook(original: Callable[..., Any], backend: Any, q: Any, k: Any, v: Any, layer: Any,
             forward_batch: Any, save_kv_cache: bool = True, **kwargs: Any) -> Any:
        if not attention.handles(backend, layer):
            return original(backend, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        return attention.forward(backend, q, k, v, layer, forward_batch, save_kv_cache, decode)

    return hook
