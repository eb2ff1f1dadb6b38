"""What the plugin does inside each scheduler process."""

from __future__ import annotations

import logging
from typing import Any

from sglang.srt.plugins.hook_registry import HookType

from omniinfer.flags import current_config
from omniinfer.sglang_plugin import hooks
from omniinfer.sglang_plugin.ranks import tp_rank

logger = logging.getLogger("omniinfer")

SCHEDULER_INIT = "sglang.srt.managers.scheduler.Scheduler.__init__"


def _after_scheduler_init(_result: Any, scheduler: Any, *_a: Any, **_k: Any) -> None:
    hooks.verify()
    config = current_config()
    scheduler.omni_config = config
    logger.info("omniinfer: scheduler tp_rank=%s received omni config %s", tp_rank(), config.to_json())


def register() -> None:
    hooks.register(SCHEDULER_INIT, _after_scheduler_init, HookType.AFTER, "omni config and hook check")
    config = current_config()
    if config.enable_omni_placement:
        from omniinfer.sglang_plugin import placement_hooks

        placement_hooks.register(config)
    if config.omni_attn_pattern is not None:
        from omniinfer.sglang_plugin import omni_attn

        omni_attn.register(config)
