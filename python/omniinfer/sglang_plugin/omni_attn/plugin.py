"""OmniAttn on the stock launcher: ``--omni-attn-pattern FILE``.

Launcher side (:func:`prepare_namespace`): the pattern is checked against the model, then the
compressed layers are declared to SGLang as hybrid sliding-window layers through
``--json-model-override-args`` (``is_hybrid_swa``, ``hybrid_layer_pattern``, ``sliding_window``
= recent - 1). SGLang then builds its two-pool KV cache: full layers in one sub-pool, compressed
layers in the SWA sub-pool, with its own allocator and window eviction. Prefix reuse stays on,
through ``--radix-cache-backend omni_attn`` (:mod:`.radix`: SGLang's unified radix
cache whose SWA component keeps every cached prefix's sink), unless the user passed
``--disable-radix-cache``. Under PD disaggregation both servers take the pattern and the
transfer carries each compressed layer's sink with its window (:mod:`.pd`).

Scheduler side (:func:`register`), all through HookRegistry:

- the sink: before SGLang frees out-of-window slots of a request, its eviction floor
  (``req.kv.swa_evict_floor``, which SGLang already honours when freeing and releasing) is
  raised to ``sink``, so frees cover ``[sink, pre_len - window)`` and never the sink;
- the budget: admission estimates and the request-cap pool size count ``window + sink`` slots;
- the memory: with ``--max-total-tokens M`` the two sub-pools together get the bytes ``M``
  tokens take without a pattern (SGLang alone would give the full pool ``M`` tokens and add the
  SWA pool on top, which frees nothing);
- attention: :mod:`.backend` serves compressed layers on ``torch_native`` (CPU), and
  :mod:`.triton_backend` is the ``omni_triton`` backend (SGLang's Triton backend for full
  layers, the sgl-kernel-npu sink + recent kernels for compressed ones; any page size);
- prefix reuse: :mod:`.radix` is registered as the radix-cache backend ``omni_attn``;
- status: :mod:`.status` writes ``attn.json`` for ``GET /omni/attn``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omniinfer.attn import runtime_window
from omniinfer.attn.pattern import Pattern, PatternError, load
from omniinfer.flags import OmniConfig, OmniFlagError
from omniinfer.sglang_plugin import internals

logger = logging.getLogger("omniinfer")

SUPPORTED_BACKENDS = ("torch_native", "omni_triton")
PAGED_BACKENDS = ("omni_triton",)  # backends that serve compressed layers at any page size
EVICTION_INTERVAL_ENV = "SGLANG_SWA_EVICTION_INTERVAL"
RADIX_BACKEND = "omni_attn"  # radix.BACKEND_NAME, without importing SGLang here


# ---------------------------------------------------------------- launcher side


def _hf_config(model_path: str) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_path)


def load_for_model(path: str, model_path: str) -> Pattern:
    """The pattern, validated against the served model; OmniFlagError in one line if not."""
    try:
        config = _hf_config(model_path)
        text_config = getattr(config, "text_config", None) or config
        pattern = load(Path(path), text_config, model_id=model_path)
    except PatternError as exc:
        raise OmniFlagError(f"--omni-attn-pattern: {exc}") from None
    except OSError as exc:
        raise OmniFlagError(f"--omni-attn-pattern: cannot read the model config: {exc}") from None
    if not pattern.compressed_layers:
        raise OmniFlagError("--omni-attn-pattern: the pattern compresses no layer")
    if len(pattern.compressed_layers) == pattern.num_layers:
        raise OmniFlagError(
            "--omni-attn-pattern: every layer is compressed; keep at least one full layer"
        )
    if pattern.recent < 2:
        raise OmniFlagError("--omni-attn-pattern: recent must be >= 2")
    return pattern


def balance_context(pattern: Pattern, config: OmniConfig) -> int:
    """The request length the pools are balanced for: ``--omni-attn-context``, else the
    pattern's own serving context, else :data:`runtime_window.DEFAULT_CONTEXT`."""
    return (config.omni_attn_context or pattern.serving_context
            or runtime_window.DEFAULT_CONTEXT)


def prepare_namespace(namespace: argparse.Namespace, config: OmniConfig) -> Pattern:
    """Turn the pattern into SGLang's hybrid-SWA settings before ServerArgs is built."""
    assert config.omni_attn_pattern is not None
    pattern = load_for_model(config.omni_attn_pattern, str(namespace.model_path))
    backend = getattr(namespace, "attention_backend", None)
    if backend not in SUPPORTED_BACKENDS:
        raise OmniFlagError(
            f"--omni-attn-pattern: needs --attention-backend {' or '.join(SUPPORTED_BACKENDS)}, "
            f"got {backend}"
        )
    overrides = {"prefill": getattr(namespace, "prefill_attention_backend", None),
                 "decode": getattr(namespace, "decode_attention_backend", None)}
    for phase, override in overrides.items():
        if override not in (None, backend):
            raise OmniFlagError(
                f"--omni-attn-pattern: --{phase}-attention-backend must be {backend} too, "
                f"got {override}"
            )
    page_size = getattr(namespace, "page_size", None)
    if page_size not in (None, 1) and backend not in PAGED_BACKENDS:
        raise OmniFlagError(
            f"--omni-attn-pattern: --page-size {page_size} needs --attention-backend "
            f"{' or '.join(PAGED_BACKENDS)} ({backend} serves compressed layers at page size 1)"
        )
    if getattr(namespace, "disable_hybrid_swa_memory", False):
        raise OmniFlagError("--omni-attn-pattern: cannot be combined with --disable-hybrid-swa-memory")
    if getattr(namespace, "speculative_algorithm", None):
        raise OmniFlagError("--omni-attn-pattern: speculative decoding is not supported")
    if getattr(namespace, "disaggregation_mode", None) not in (None, "null"):
        _check_pd(namespace, page_size)
    raw = getattr(namespace, "json_model_override_args", None) or "{}"
    try:
        model_overrides = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise OmniFlagError(f"--json-model-override-args is not valid JSON: {exc.msg}") from None
    model_overrides.update(
        runtime_window.model_overrides(pattern.num_layers, pattern.compressed_layers, pattern.recent)
    )
    namespace.json_model_override_args = json.dumps(model_overrides)
    _choose_radix_cache(namespace)
    if (
        getattr(namespace, "swa_full_tokens_ratio", None) is None
        and getattr(namespace, "max_running_requests", None) is None
    ):
        budget = getattr(namespace, "max_total_tokens", None)
        context = balance_context(pattern, config)
        namespace.swa_full_tokens_ratio = (
            runtime_window.balanced_swa_ratio(
                budget, pattern.num_layers, len(pattern.compressed_layers), pattern.sink,
                pattern.recent, context=context,
                prefill_chunk=getattr(namespace, "chunked_prefill_size", None),
            )
            if budget
            else runtime_window.default_swa_ratio(pattern.sink, pattern.recent, context=context)
        )
    # SGLang frees window slots in batches of this many tokens (its default is 128).
    os.environ.setdefault(EVICTION_INTERVAL_ENV, str(runtime_window.EVICTION_INTERVAL))
    logger.info(
        "omniinfer: OmniAttn compresses layers %s (sink %d, recent %d)",
        list(pattern.compressed_layers), pattern.sink, pattern.recent,
    )
    return pattern


def _check_pd(namespace: argparse.Namespace, page_size: int | None) -> None:
    """What OmniAttn under PD supports (page size 1; no decode-side radix cache)."""
    if page_size not in (None, 1):
        raise OmniFlagError(
            "--omni-attn-pattern: with --disaggregation-mode the compressed layers' sink is "
            f"transferred at page size 1 only; got --page-size {page_size}"
        )
    if getattr(namespace, "disaggregation_decode_enable_radix_cache", False):
        raise OmniFlagError(
            "--omni-attn-pattern: --disaggregation-decode-enable-radix-cache does not keep the "
            "compressed layers' sink on the decode server; drop it"
        )


def _choose_radix_cache(namespace: argparse.Namespace) -> None:
    """Prefix reuse through the sink-aware tree unless the user turned the radix cache off."""
    if getattr(namespace, "disable_radix_cache", False):
        return
    chosen = getattr(namespace, "radix_cache_backend", None)
    if chosen not in (None, RADIX_BACKEND):
        raise OmniFlagError(
            f"--omni-attn-pattern: --radix-cache-backend {chosen} does not keep the sink; "
            f"use {RADIX_BACKEND} (the default) or --disable-radix-cache"
        )
    for field in internals.RADIX_CONFLICT_FIELDS:
        if getattr(namespace, field.name, False):
            raise OmniFlagError(
                f"--omni-attn-pattern: --{field.name.replace('_', '-')} replaces the sink-aware "
                "radix cache; drop it or add --disable-radix-cache"
            )
    namespace.radix_cache_backend = RADIX_BACKEND


# ---------------------------------------------------------------- scheduler side


class _State:
    pattern: Pattern | None = None
    attention: Any = None
    status: Any = None


def _raise_floor(req: Any) -> None:
    pattern = _State.pattern
    assert pattern is not None
    kv = req.kv
    if kv.swa_evict_floor < pattern.sink:
        kv.swa_evict_floor = pattern.sink


def _around_evict(original: Callable[..., Any], cache: Any, req: Any, pre_len: int,
                  *args: Any, **kwargs: Any) -> Any:
    """Keep the sink, count the slots the window frees."""
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    if not req.kv.holds_kv:
        return original(cache, req, pre_len, *args, **kwargs)
    _raise_floor(req)
    before = max(req.kv.get_evicted_seqlen(ComponentType.SWA), req.kv.swa_dead_lo(cache.page_size))
    result = original(cache, req, pre_len, *args, **kwargs)
    after = req.kv.get_evicted_seqlen(ComponentType.SWA)
    if _State.status is not None and after > before:
        _State.status.on_freed(after - before)
    return result


def _around_component_free(original: Callable[..., Any], component: Any, req: Any,
                           pre_len: int) -> Any:
    if req.kv.holds_kv:
        _raise_floor(req)
    return original(component, req, pre_len)


def _with_sink_window(decl: internals.Internal) -> Callable[..., Any]:
    """AROUND hook for the declared function whose one declared parameter is the window:
    admission and pool-cap arithmetic count window + sink slots for a compressed layer."""
    (name,) = decl.params

    def hook(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        pattern = _State.pattern
        assert pattern is not None
        bound = internals.bind(decl, args, kwargs)
        if bound.arguments.get(name):
            bound.arguments[name] += pattern.sink
        return original(*bound.args, **bound.kwargs)

    return hook


def _around_sizes_from_max_tokens(original: Callable[..., Any], configurator: Any,
                                  max_total_num_tokens: int, page_size: int) -> Any:
    """``--max-total-tokens M`` means the KV bytes of M tokens in the uncompressed model
    (reads the configurator's private sizes, declared in ``internals.POOL_CONFIGURATOR_FIELDS``)."""
    full_layers = configurator._full_layers_num
    swa_layers = configurator._swa_layers_num
    if full_layers == 0:
        return original(configurator, max_total_num_tokens, page_size)
    per_token = (
        configurator._full_per_token * full_layers + configurator._swa_per_token * swa_layers
    )
    config = configurator.calculate_pool_sizes(max_total_num_tokens * per_token, page_size)
    logger.info(
        "omniinfer: OmniAttn KV budget of %d uncompressed tokens -> full pool %d tokens, "
        "compressed pool %d tokens", max_total_num_tokens,
        config.full_max_total_num_tokens, config.swa_max_total_num_tokens,
    )
    return config


def _free_after_prefill(_result: Any, scheduler: Any, batch: Any, *_a: Any, **_k: Any) -> None:
    """Free the compressed layers' out-of-window prompt slots as soon as the prefill is done.

    SGLang frees them at a request's second decode step at the earliest, so a burst of long
    prompts holds whole prompts in the compressed pool while the next prefills are admitted;
    freeing here leaves each finished prefill holding only ``sink + window`` slots. Safe with
    the overlap scheduler too: the batch launched meanwhile is a decode that reads the window.
    """
    if batch is not None and batch.forward_mode.is_prebuilt():
        from omniinfer.sglang_plugin.omni_attn.pd import free_after_transfer

        free_after_transfer(scheduler, batch)  # decode under PD: the KV just arrived
        return
    if batch is None or not batch.forward_mode.is_extend() or batch.is_dllm():
        return
    cache = scheduler.tree_cache  # declared: internals.SCHEDULER_TREE_CACHE
    if cache is None or not cache.supports_swa() or scheduler.disaggregation_mode.value == "prefill":
        return
    allocator = scheduler.token_to_kv_pool_allocator
    allocator.free_group_begin()
    try:
        for req, written in zip(batch.reqs, batch.seq_lens_cpu.tolist(), strict=True):
            if req.finished() or not req.kv.holds_kv or written != prefill_done_at(req):
                continue  # a chunk: the tree takes it at the next chunk; nothing to free yet
            cache.evict_sliding_windows(req, written)  # the prompt's KV is written
    finally:
        allocator.free_group_end()


def prefill_done_at(req: Any) -> int:
    """The length an extend batch reaches when it completes ``req``'s prefill: the request's
    sequence less the token that result just appended. A chunk of a longer prompt stops
    short of it (SGLang's ``inflight_middle_chunks`` is already drained when the result has
    been processed, and never counted the last chunk)."""
    return req.seqlen - 1


def _refresh_status(_result: Any, _batch: Any, *_a: Any, **_k: Any) -> None:
    if _State.status is not None:
        _State.status.maybe_write()


def _after_scheduler_init(_result: Any, scheduler: Any, *_a: Any, **_k: Any) -> None:
    from omniinfer.sglang_plugin.omni_attn.status import AttnStatus
    from omniinfer.sglang_plugin.ranks import tp_rank

    assert _State.pattern is not None
    _State.status = AttnStatus.from_scheduler(
        scheduler, _State.pattern, _State.attention, writer=tp_rank() in (0, None)
    )
    _State.status.write()
    logger.info("omniinfer: OmniAttn pools %s", json.dumps(_State.status.pools()))


def register(config: OmniConfig) -> None:
    """Worker-side hooks; the launcher already validated the pattern against the model."""
    from sglang.srt.plugins.hook_registry import HookType

    from omniinfer.sglang_plugin import hooks, targets
    from omniinfer.sglang_plugin.omni_attn import pd, radix, triton_backend
    from omniinfer.sglang_plugin.omni_attn.backend import CompressedAttention, around_forward

    assert config.omni_attn_pattern is not None
    pattern = load(Path(config.omni_attn_pattern))
    _State.pattern = pattern
    _State.attention = CompressedAttention(pattern.compressed_layers, pattern.sink, pattern.recent)
    triton_backend.set_pattern(pattern.compressed_layers, pattern.sink, pattern.recent)
    radix.configure(pattern.sink)
    pd.configure(pattern.sink, pattern.num_layers, len(pattern.compressed_layers))
    radix.register_backend()  # selected by the launcher's --radix-cache-backend
    t, around, after = targets, HookType.AROUND, HookType.AFTER
    wanted: list[tuple[targets.Target, Callable[..., Any], HookType]] = [
        (t.TORCH_NATIVE_EXTEND, around_forward(_State.attention, False), around),
        (t.TORCH_NATIVE_DECODE, around_forward(_State.attention, True), around),
        (t.EVICT_SLIDING_WINDOWS, _around_evict, around),
        (t.SWA_COMPONENT_FREE, _around_component_free, around),
        (t.ESTIMATE_SWA_TOKENS, _with_sink_window(internals.ESTIMATE_SWA_TOKENS), around),
        (t.SWA_REQUEST_CAP, _with_sink_window(internals.SWA_REQUEST_CAP), around),
        *[(target, _around_sizes_from_max_tokens, around) for target in t.POOL_SIZES],
        (t.PROCESS_BATCH_RESULT, _free_after_prefill, after),
        (t.MAYBE_EVICT_SWA, _refresh_status, after),
        (t.SCHEDULER_ON_IDLE, _refresh_status, after),
        (t.SCHEDULER_INIT, _after_scheduler_init, after),
        (t.SEND_KV_CHUNK, pd.around_send_kv_chunk, around),
        (t.SEND_KV_METADATA, pd.around_send_kv_metadata, around),
    ]
    for target, hook, kind in wanted:
        hooks.register(target, hook, kind)
