"""What the plugin does inside each scheduler process."""

from __future__ import annotations

import logging
from typing import Any

from sglang.srt.plugins.hook_registry import HookType

from omniinfer.flags import OmniConfig, current_config
from omniinfer.sglang_plugin import hooks, internals, targets
from omniinfer.sglang_plugin.ranks import tp_rank

logger = logging.getLogger("omniinfer")


def check_sglang(config: OmniConfig, scheduler: Any) -> None:
    """Stop this scheduler unless the installed SGLang has every name the switched-on features
    use (:func:`internals.check`), every hook target resolved (:func:`hooks.verify`) and, with
    an OmniAttn pattern on, ``scheduler``'s tree cache is the sink-aware one on SGLang's Python
    tree core (:func:`omniinfer.sglang_plugin.omni_attn.radix.require_sink_tree`)."""
    from omniinfer.cpu.detect import cpu_engine_active

    internals.check(internals.start_up_features(
        placement=config.enable_omni_placement,
        omni_attn=config.omni_attn_pattern is not None,
        cpu_engine=cpu_engine_active(),
    ))
    hooks.verify()
    if config.omni_attn_pattern is not None:
        from omniinfer.sglang_plugin.omni_attn.radix import require_sink_tree

        require_sink_tree(scheduler)


def _after_scheduler_init(_result: Any, scheduler: Any, *_a: Any, **_k: Any) -> None:
    config = current_config()
    check_sglang(config, scheduler)
    scheduler.omni_config = config
    logger.info("omniinfer: scheduler tp_rank=%s received omni config %s", tp_rank(), config.to_json())


def register() -> None:
    hooks.register(targets.SCHEDULER_INIT, _after_scheduler_init, HookType.AFTER)
    from omniinfer.sglang_plugin.placement import eplb_adapter

    eplb_adapter.register()
    config = current_config()
    if config.enable_omni_placement:
        from omniinfer.sglang_plugin.placement import plugin as placement_plugin

        placement_plugin.register(config)
    if config.omni_attn_pattern is not None:
        from omniinfer.sglang_plugin.omni_attn import plugin as omni_attn_plugin

        omni_attn_plugin.register(config)
