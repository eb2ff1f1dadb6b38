"""SGLang's own EPLB on a model that does not publish its expert weights.

SGLang 0.5.23's ``EPLBManager`` reads ``model.routed_experts_weights_of_layer`` ({MoE layer id:
the routed experts' weight tensors}) when it rebalances. qwen3_moe, deepseek_v2 and others set
it; qwen2_moe does not, so ``--enable-eplb`` on a Qwen2-MoE model (the project's SmolLM2-MoE)
fails at the first rebalance with an ``AttributeError``. The adapter wraps the manager's model
getter (``EPLBManager._get_model``, declared in :mod:`..internals`) so that the model it returns
carries the descriptor, built the way the other models build theirs (each MoE layer's
``mlp.get_moe_weights()``: views of the parameters, so SGLang's in-place copies move the real
weights). A model that already publishes one is left as it is. Nothing else of EPLB changes:
its algorithm, period and synchronous transfer are SGLang's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from sglang.srt.plugins.hook_registry import HookType

from omniinfer.sglang_plugin import hooks, internals, targets

logger = logging.getLogger("omniinfer")

DESCRIPTOR = "routed_experts_weights_of_layer"


def publish_expert_weights(model: Any) -> bool:
    """Set ``model.routed_experts_weights_of_layer`` unless the model has one; True when set.
    Raises ``RuntimeError`` for a model without MoE layers that expose their weights."""
    if getattr(model, DESCRIPTOR, None) is not None:
        return False
    from omniinfer.sglang_plugin.placement.runtime import routed_expert_weights

    setattr(model, DESCRIPTOR, routed_expert_weights(model))
    logger.info("omniinfer: %s publishes no %s; built from its MoE layers for SGLang's EPLB",
                type(model).__name__, DESCRIPTOR)
    return True


def with_published_weights(get_model: Callable[[], Any]) -> Callable[[], Any]:
    """``get_model`` whose model carries the descriptor (built on the first call that needs it:
    the getter is called at rebalance time, after the model has loaded)."""
    def model_with_weights() -> Any:
        model = get_model()
        publish_expert_weights(model)
        return model
    return model_with_weights


def _after_manager_init(_result: Any, manager: Any, *_args: Any, **_kwargs: Any) -> None:
    internals.check(declared=[internals.EPLB_GET_MODEL])
    manager._get_model = with_published_weights(manager._get_model)


def register() -> None:
    hooks.register(targets.EPLB_MANAGER_INIT, _after_manager_init, HookType.AFTER)
