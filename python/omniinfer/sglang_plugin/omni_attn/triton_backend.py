"""``--attention-backend omni_triton``: SGLang's Triton backend plus OmniAttn compressed layers.

Registered through SGLang's ``register_attention_backend`` (and added to the
``--attention-backend`` choices). Full layers run :class:`TritonAttnBackend` unchanged. A
compressed layer (one of the pattern's layers, which the plugin declared to SGLang as a
hybrid-SWA layer) is served from the SWA sub-pool of SGLang's :class:`SWAKVPool`: K/V are
written there by SGLang's own write path, then the ``sgl-kernel-npu`` kernels read each
request's sink + recent keys through ``req_to_token`` and the pool's full-to-SWA slot map
(``full_to_swa_index_mapping``), with no index list and no host sync in decode:

- decode: ``omni_kernel_npu.omni_attn.decode_sink_recent`` (graph-capturable);
- extend: ``omni_kernel_npu.omni_attn.extend_sink_recent`` (sink-aware causal window).

Any page size works: the kernels address one slot per token and SGLang's NHD pool keeps a page
as consecutive slots. Nothing here is device-specific (Triton compiles for CUDA and, through
triton-ascend, for Ascend; under ``TRITON_INTERPRET=1`` it runs on CPU).

The kernels are the installed package ``omni_kernel_npu`` (distribution
``omniinfer-sgl-kernel-npu``, the repository's ``sgl-kernel-npu/``; ``scripts/setup.sh``
installs it, or ``pip install -e sgl-kernel-npu --no-deps``). They are imported when the
backend is created, so without them only ``--attention-backend omni_triton`` fails, at start-up,
naming the package; ``torch_native`` serving does not need them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection
from typing import Any

import torch

BACKEND_NAME = "omni_triton"
KERNEL_DISTRIBUTION = "omniinfer-sgl-kernel-npu"


class KernelsMissingError(ImportError):
    """The ``omni_kernel_npu`` package (the OmniAttn Triton kernels) is not installed."""


@functools.cache
def kernels() -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]:
    """(decode, extend) kernels of the installed ``omni_kernel_npu``; KernelsMissingError,
    saying how to install it, when the package is absent."""
    try:
        from omni_kernel_npu.omni_attn import decode_sink_recent, extend_sink_recent
    except ModuleNotFoundError as exc:
        if exc.name is None or not exc.name.startswith("omni_kernel_npu"):
            raise  # the package is there but one of its own imports failed: show that
        raise KernelsMissingError(
            f"--attention-backend {BACKEND_NAME} needs the OmniAttn Triton kernels, package "
            f"omni_kernel_npu (distribution {KERNEL_DISTRIBUTION}, the repository's "
            "sgl-kernel-npu/), which is not installed: run scripts/setup.sh or "
            "`pip install -e sgl-kernel-npu --no-deps` from the repository root",
            name="omni_kernel_npu",
        ) from exc
    return decode_sink_recent.decode_sink_recent, extend_sink_recent.extend_sink_recent


class SinkRecentLayers:
    """Which layers are compressed and how: the pattern's part the attention needs. The
    kernels are looked up on first use (:func:`kernels`)."""

    def __init__(self, layers: Collection[int], sink: int, recent: int) -> None:
        self.layers = frozenset(layers)
        self.sink, self.recent = sink, recent

    @property
    def decode_kernel(self) -> Callable[..., torch.Tensor]:
        return kernels()[0]

    @property
    def extend_kernel(self) -> Callable[..., torch.Tensor]:
        return kernels()[1]

    def handles(self, pool: Any, layer: Any) -> bool:
        mapping = getattr(pool, "layers_mapping", None)
        return (
            layer.layer_id in self.layers
            and not getattr(layer, "is_cross_attention", False)
            and mapping is not None
            and mapping[layer.layer_id][1]  # the layer lives in the SWA sub-pool
        )

    def attend(self, pool: Any, req_to_token: torch.Tensor, q: torch.Tensor, layer: Any,
               req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
               qo_indptr: torch.Tensor | None = None, max_extend_len: int | None = None
               ) -> torch.Tensor:
        """Sink + recent attention of ``q`` over the layer's SWA sub-pool; K/V already written.

        Decode when ``qo_indptr`` is None (one query per request), extend otherwise. Returns
        ``[tokens, q_heads * v_head_dim]``.
        """
        cap = float(layer.logit_cap or 0.0)
        if cap > 0 and getattr(layer, "logit_capping_method", "tanh") != "tanh":
            raise NotImplementedError("OmniAttn compressed layers: only tanh logit capping")
        heads, dim, v_dim = layer.tp_q_head_num, layer.qk_head_dim, layer.v_head_dim
        query = q.reshape(-1, heads, dim)
        scale = float(layer.scaling)
        v_descale = 1.0
        if getattr(layer, "k_scale", None) is not None:
            scale *= float(layer.k_scale_float)
            v_descale = float(layer.v_scale_float)
        key_buf = pool.get_key_buffer(layer.layer_id)
        value_buf = pool.get_value_buffer(layer.layer_id)
        out = query.new_empty((query.shape[0], heads, v_dim))
        common = dict(sm_scale=scale, logit_cap=cap, slot_map=pool.full_to_swa_index_mapping,
                      out=out)
        if qo_indptr is None:
            self.decode_kernel(query, key_buf, value_buf, req_to_token, req_pool_indices,
                               seq_lens, self.sink, self.recent, **common)
        else:
            self.extend_kernel(query, key_buf, value_buf, req_to_token, req_pool_indices,
                               seq_lens, qo_indptr, self.sink, self.recent,
                               max_extend_len=max_extend_len, **common)
        if v_descale != 1.0:
            out.mul_(v_descale)
        return out.reshape(-1, heads * v_dim)


class _State:
    layers: SinkRecentLayers | None = None


def set_pattern(layers: Collection[int], sink: int, recent: int) -> None:
    """Called by the scheduler-side OmniAttn registration (the pattern is known there)."""
    _State.layers = SinkRecentLayers(layers, sink, recent)


@functools.cache
def backend_class() -> type:
    """:class:`TritonAttnBackend` with compressed layers routed to the sink + recent kernels
    (built on first use: importing SGLang's Triton backend needs the model runtime)."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    class OmniTritonAttnBackend(TritonAttnBackend):
        """See the module docstring; full layers are the parent's code path."""

        def _omni_layer(self, layer: Any, forward_batch: Any, sinks: Any) -> bool:
            attn = _State.layers
            if attn is None or not attn.handles(self.token_to_kv_pool, layer):
                return False
            mode = forward_batch.forward_mode
            if (mode.is_target_verify() or mode.is_draft_extend_v2() or mode.is_dllm_extend()
                    or sinks is not None):
                raise NotImplementedError(
                    f"OmniAttn compressed layers: unsupported forward mode {mode} / sinks")
            return True

        def _omni_write(self, layer: Any, forward_batch: Any, k: Any, v: Any) -> None:
            loc = KVWriteLoc.for_batch(forward_batch,
                                       swa_loc=self.forward_metadata.swa_out_cache_loc)
            self._set_kv_buffer(forward_batch, layer, loc, k, v, layer.k_scale, layer.v_scale)

        def forward_decode(self, q: Any, k: Any, v: Any, layer: Any, forward_batch: Any,
                           save_kv_cache: bool = True, sinks: Any = None, **kwargs: Any) -> Any:
            if not self._omni_layer(layer, forward_batch, sinks):
                return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache,
                                              sinks=sinks, **kwargs)
            if save_kv_cache:
                self._omni_write(layer, forward_batch, k, v)
            assert _State.layers is not None
            return _State.layers.attend(self.token_to_kv_pool, self.req_to_token, q, layer,
                                        forward_batch.req_pool_indices, forward_batch.seq_lens)

        def forward_extend(self, q: Any, k: Any, v: Any, layer: Any, forward_batch: Any,
                           save_kv_cache: bool = True, sinks: Any = None, **kwargs: Any) -> Any:
            if not self._omni_layer(layer, forward_batch, sinks):
                return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache,
                                              sinks=sinks, **kwargs)
            if save_kv_cache and k is not None and v is not None:
                self._omni_write(layer, forward_batch, k, v)
            meta = self.forward_metadata
            assert _State.layers is not None
            return _State.layers.attend(self.token_to_kv_pool, self.req_to_token, q, layer,
                                        forward_batch.req_pool_indices, forward_batch.seq_lens,
                                        meta.qo_indptr, meta.max_extend_len)

    return OmniTritonAttnBackend


def create_backend(runner: Any) -> Any:
    """SGLang's factory signature (``ATTENTION_BACKENDS[name](model_runner)``)."""
    if runner.model_config.is_encoder_decoder:
        raise ValueError(f"--attention-backend {BACKEND_NAME}: no cross attention")
    kernels()  # a missing kernel package stops the server here, naming it
    return backend_class()(runner)


def register_backend(with_factory: bool) -> None:
    """Add the name to ``--attention-backend``'s choices (every process) and, where models
    run, the factory to SGLang's registry."""
    from sglang.srt.arg_groups.choices import (
        ATTENTION_BACKEND_CHOICES,
        add_attention_backend_choices,
    )

    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    if with_factory:
        from sglang.srt.layers.attention.attention_registry import (
            ATTENTION_BACKENDS,
            register_attention_backend,
        )

        if BACKEND_NAME not in ATTENTION_BACKENDS:
            register_attention_backend(BACKEND_NAME)(create_backend)
