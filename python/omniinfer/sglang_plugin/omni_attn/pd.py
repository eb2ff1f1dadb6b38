"""OmniAttn under PD disaggregation: the compressed layers' sink travels with their window.

SGLang 0.5.23 already moves hybrid sliding-window layers between a prefill and a decode server:
the prefill side sends an SWA layer's window pages as the ``StateType.SWA`` payload of a
request's last chunk, and the decode side lists the same window of its own slots to receive
them. OmniAttn's compressed layers are declared as such layers, so what PD lacks is the sink.
Here, through HookRegistry:

- prefill (AROUND ``SchedulerDisaggregationPrefillMixin._send_kv_chunk``): the sender of a
  request's last chunk gets the sink pages (``runtime_window.transfer_sink_span``) put before
  the window pages of the SWA payload; every send is metered (bytes of full layers, bytes of
  compressed layers, and what the same tokens of all layers would have been);
- decode (AROUND ``DecodePreallocQueue._send_kv_metadata``): the same sink pages of the decode
  side's own slots are put before its window pages, so the two lists match page for page, and
  the request's eviction floor is raised to the sink at once (its sink slots must never be
  freed, even by a request that finishes before its first window eviction);
- decode (the ``PREBUILT`` batch, in :func:`free_after_transfer`): once a request's KV has
  arrived, its compressed layers' slots between the sink and the window are freed, so a
  decoding request holds ``sink + window`` compressed slots (plus what waits for the next free).

Supported at page size 1 (the CPU engine's ``torch_native``); the launcher refuses a larger
page size and SGLang's decode-side radix cache under PD, each in one line.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from omniinfer.attn import runtime_window
from omniinfer.sglang_plugin import internals

logger = logging.getLogger("omniinfer")

# The keyword SGLang passes to ``_send_kv_metadata`` (and on to the receiver's
# ``send_metadata``, whose signature declares it).
(_DECODE_PREFIX_LEN,) = internals.RECEIVER_SEND_METADATA.params


@dataclass
class TransferMeter:
    """What the prefill side sent, in bytes (cumulative over requests)."""

    requests: int = 0
    tokens: int = 0
    full_layer_bytes: int = 0
    compressed_layer_bytes: int = 0
    sink_pages: int = 0
    uncompressed_bytes: int = 0  # the same tokens with every layer full (no pattern)

    def describe(self) -> dict[str, Any]:
        sent = self.full_layer_bytes + self.compressed_layer_bytes
        return {
            "requests": self.requests, "tokens": self.tokens,
            "full_layer_bytes": self.full_layer_bytes,
            "compressed_layer_bytes": self.compressed_layer_bytes,
            "sink_pages": self.sink_pages,
            "bytes_without_pattern": self.uncompressed_bytes,
            "saved_fraction": round(1 - sent / self.uncompressed_bytes, 4)
            if self.uncompressed_bytes else None,
        }


class _State:
    sink = 0
    num_layers = 0
    num_compressed = 0
    meter = TransferMeter()


def configure(sink: int, num_layers: int, num_compressed: int) -> None:
    _State.sink, _State.num_layers, _State.num_compressed = sink, num_layers, num_compressed


def meter() -> TransferMeter:
    return _State.meter


def _token_bytes(pool: Any) -> int:
    """Bytes one token takes in one layer of ``pool`` (K and V)."""
    return int(pool.k_buffer[0][0].nbytes + pool.v_buffer[0][0].nbytes)


def _sink_pages(req_to_token: Any, allocator: Any, row: int, lo: int, hi: int,
                page_size: int) -> Any:
    """The compressed-pool page ids of positions ``[lo, hi)`` of one request row."""
    from sglang.srt.mem_cache.common import kv_to_page_indices

    full = req_to_token[row, lo:hi]
    swa = allocator.translate_swa_indices_for_transfer(full)
    if hi > lo and bool((swa == 0).any()):
        raise RuntimeError("omniinfer: a compressed layer's sink slot was freed before the "
                           "PD transfer (the sink floor did not hold)")
    return kv_to_page_indices(swa, page_size)


def _with_sink(state_indices: list[Any] | None, state_types: list[Any], pages: Any) -> Any:
    """The state payload with ``pages`` before the SWA entry's window pages."""
    import numpy as np
    from sglang.srt.disaggregation.base.conn import StateType

    if state_indices is None or StateType.SWA not in state_types or len(pages) == 0:
        return state_indices
    out = list(state_indices)
    at = state_types.index(StateType.SWA)
    window = out[at]
    out[at] = np.concatenate([np.asarray(pages, dtype=np.asarray(window).dtype), window])
    return out


def around_send_kv_chunk(original: Any, scheduler: Any, req: Any, last_chunk: bool = False,
                         end_idx: int | None = None) -> Any:
    """Prefill: add the sink pages to the last chunk's SWA payload; meter every send."""
    from sglang.srt.disaggregation.base.conn import StateType

    sender = req.disagg_kv_sender  # declared: internals.REQ_KV_SENDER (None without PD)
    if sender is None:
        return original(scheduler, req, last_chunk, end_idx)
    allocator = scheduler.token_to_kv_pool_allocator
    kvcache = allocator.get_kvcache()
    page_size = allocator.page_size
    state_types = scheduler.disagg_prefill_bootstrap_queue.kv_manager.kv_args.state_types
    seq_len = min(req.extend_end, len(req.origin_input_ids))
    lo, hi = runtime_window.transfer_sink_span(
        req.disagg_decode_prefix_len, seq_len, scheduler.sliding_window_size, _State.sink,
        page_size)
    pages = (_sink_pages(scheduler.req_to_token_pool.req_to_token, allocator,
                         int(req.kv.req_pool_idx), lo, hi, page_size)
             if last_chunk and hi > lo else [])
    full_bytes = _token_bytes(kvcache.full_kv_pool) * (_State.num_layers - _State.num_compressed)
    swa_bytes = _token_bytes(kvcache.swa_kv_pool) * _State.num_compressed
    plain_send = sender.send

    def send(page_indices: Any, state_indices: Any = None, *args: Any, **kwargs: Any) -> Any:
        state_indices = _with_sink(state_indices, state_types, pages)
        m = _State.meter
        tokens = len(page_indices) * page_size
        m.tokens += tokens
        m.full_layer_bytes += tokens * full_bytes
        m.uncompressed_bytes += tokens * (full_bytes + swa_bytes)
        if state_indices is not None and StateType.SWA in state_types:
            swa_pages = len(state_indices[state_types.index(StateType.SWA)])
            m.compressed_layer_bytes += swa_pages * page_size * swa_bytes
            m.sink_pages += len(pages)
            m.requests += 1
        return plain_send(page_indices, state_indices, *args, **kwargs)

    sender.send = send
    try:
        return original(scheduler, req, last_chunk, end_idx)
    finally:
        del sender.send  # the class's method again


def around_send_kv_metadata(original: Any, queue: Any, decode_req: Any, kv_indices: Any,
                            page_size: int, state_indices: Any = None, **kwargs: Any) -> Any:
    """Decode: receive the sink pages into this side's sink slots, and keep them."""
    if _DECODE_PREFIX_LEN not in kwargs:  # SGLang 0.5.23 passes it on every call
        raise RuntimeError(
            "OmniAttn PD: DecodePreallocQueue._send_kv_metadata was called without "
            "decode_prefix_len; this SGLang version is not supported (the sink span needs it)"
        )
    req = decode_req.req
    if req.kv.swa_evict_floor < _State.sink:
        req.kv.swa_evict_floor = _State.sink
    allocator = queue.token_to_kv_pool_allocator
    lo, hi = runtime_window.transfer_sink_span(
        kwargs[_DECODE_PREFIX_LEN], len(req.origin_input_ids),
        queue.scheduler.sliding_window_size, _State.sink, allocator.page_size)
    if hi > lo and state_indices is not None:
        pages = _sink_pages(queue.req_to_token_pool.req_to_token, allocator,
                            int(req.kv.req_pool_idx), lo, hi, allocator.page_size)
        state_indices = _with_sink(state_indices, queue.kv_manager.kv_args.state_types, pages)
    return original(queue, decode_req, kv_indices, page_size, state_indices, **kwargs)


def free_after_transfer(scheduler: Any, batch: Any) -> None:
    """Decode: a request whose KV arrived (the ``PREBUILT`` batch) frees its compressed
    layers' slots between the sink and the window."""
    if scheduler.disaggregation_mode.value != "decode" or not batch.forward_mode.is_prebuilt():
        return
    cache = scheduler.tree_cache  # declared: internals.SCHEDULER_TREE_CACHE
    if cache is None or not cache.supports_swa():
        return
    allocator = scheduler.token_to_kv_pool_allocator
    allocator.free_group_begin()
    try:
        for req in batch.reqs:
            if req.finished() or not req.kv.holds_kv:
                continue
            cache.evict_sliding_windows(req, req.seqlen - 1)
    finally:
        allocator.free_group_end()
