"""Scheduler-side fixes for the CPU engine.

Expert parallelism (``--tp 2 --ep 2``):

1. SGLang picks the pynccl communicator by platform, not by device, so on CPU it tries NCCL
   (``Expected a cuda device, but got: cpu``). On the CPU engine every group is built without it.
2. SGLang's native MoE path cannot take the -1 ids of experts held by another rank; those
   calls go to :func:`omniinfer.cpu.moe_native.masked_moe_forward`.

PD disaggregation over Mooncake's TCP transport (only when the launcher set
:data:`omniinfer.cpu.server_defaults.PD_MOONCAKE_ENV`):

3. Mooncake's KV sender announces that it takes page indices as a host tensor; the prefill
   scheduler then stages them through pinned memory and a ``torch.cuda.Event``. On the CPU engine
   each sender says no, so the scheduler hands it NumPy indices.
4. A PD scheduler with queued requests but nothing to compute returns from ``on_idle`` after a
   ``time.sleep(0)`` and loops, spinning a core the co-located server needs; with
   :data:`omniinfer.cpu.server_defaults.PD_POLL_MS_ENV` it waits that many milliseconds on its
   sockets (a new request wakes it at once).

Data parallelism (``--dp-size`` > 1; only when the launcher set
:data:`omniinfer.cpu.server_defaults.DP_WAIT_MS_ENV`):

5. SGLang's DP controller receives from the tokenizer with a non-blocking call in an endless
   loop, spinning a whole core while idle. Its socket is wrapped so that a non-blocking receive
   first waits up to that many milliseconds for a message (it returns at once when one is
   there), so the loop sleeps in the kernel instead.

Registered only when :func:`omniinfer.cpu.detect.cpu_engine_active` is true.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import zmq
from sglang.srt.plugins.hook_registry import HookType

from omniinfer.cpu.moe_native import masked_moe_forward
from omniinfer.cpu.server_defaults import DP_WAIT_MS_ENV, PD_MOONCAKE_ENV, PD_POLL_MS_ENV
from omniinfer.cpu.torch_compat import patch_torch
from omniinfer.sglang_plugin import hooks, internals, targets

logger = logging.getLogger("omniinfer")


def _without_pynccl(*args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """BEFORE ``GroupCoordinator.__init__(self, ...)``: the same call with ``use_pynccl=False``,
    found by binding the call to the declared signature (by position or by keyword)."""
    return internals.replace_argument(internals.GROUP_COORDINATOR_INIT, args, kwargs,
                                      "use_pynccl", False)


def _moe_forward_masked(
    original: Callable[..., Any], layer: Any, x: Any, topk_output: Any, moe_runner_config: Any
) -> Any:
    topk_weights, topk_ids, _ = topk_output
    if not bool((topk_ids < 0).any()):
        return original(layer, x, topk_output, moe_runner_config)
    if moe_runner_config.apply_router_weight_on_input or moe_runner_config.gemm1_alpha is not None:
        raise NotImplementedError("masked CPU MoE: router-weight-on-input and gemm1_alpha are not supported")
    return masked_moe_forward(
        x,
        topk_weights,
        topk_ids,
        layer.w13_weight,
        layer.w2_weight,
        moe_runner_config.activation,
        getattr(layer, "w13_weight_bias", None),
        getattr(layer, "w2_weight_bias", None),
    )


def _sender_takes_numpy_indices(_result: Any, sender: Any, *_a: Any, **_k: Any) -> None:
    sender.supports_host_tensor_indices = False


def _pd_poll_wait(wait_ms: int) -> Callable[..., Any]:
    def around_on_idle(original: Callable[..., Any], scheduler: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(scheduler, *args, **kwargs)
        if scheduler.disaggregation_mode.value != "null":  # declared: SCHEDULER_PD_MODE
            sleeper = scheduler.idle_sleeper  # declared; None without --sleep-on-idle
            poller = getattr(sleeper, internals.IDLE_SLEEPER_POLLER.name, None)  # none: Rust's
            if poller is not None:
                poller.poll(wait_ms)  # returns early when a request arrives
            else:
                time.sleep(wait_ms / 1000)
        return result

    return around_on_idle


class WaitingReceiver:
    """A zmq socket whose non-blocking receive first waits up to ``wait_ms`` for a message
    (``poll`` returns at once when one is queued); everything else is the socket's own."""

    def __init__(self, socket: Any, wait_ms: int) -> None:
        self._socket, self._wait_ms = socket, wait_ms

    def recv(self, flags: int = 0, **kwargs: Any) -> Any:
        self._wait(flags)
        return self._socket.recv(flags=flags, **kwargs)

    def recv_pyobj(self, flags: int = 0, **kwargs: Any) -> Any:
        self._wait(flags)
        return self._socket.recv_pyobj(flags=flags, **kwargs)

    def _wait(self, flags: int) -> None:
        if flags & zmq.NOBLOCK:
            self._socket.poll(self._wait_ms, zmq.POLLIN)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._socket, name)


def _dp_controller_waits(wait_ms: int) -> Callable[..., Any]:
    receiver = internals.DP_CONTROLLER_RECEIVER.name

    def around_event_loop(original: Callable[..., Any], controller: Any, *args: Any,
                          **kwargs: Any) -> Any:
        socket = getattr(controller, receiver)  # declared: a rename fails at start-up
        if not isinstance(socket, WaitingReceiver):
            setattr(controller, receiver, WaitingReceiver(socket, wait_ms))
        return original(controller, *args, **kwargs)

    return around_event_loop


def register() -> None:
    patched = patch_torch()
    if patched:
        logger.info("omniinfer: CPU engine, filled in %s", ", ".join(patched))
    hooks.register(targets.GROUP_COORDINATOR_INIT, _without_pynccl, HookType.BEFORE)
    hooks.register(targets.MOE_FORWARD_NATIVE, _moe_forward_masked, HookType.AROUND)
    if os.environ.get(PD_MOONCAKE_ENV) == "1":
        hooks.register(targets.MOONCAKE_SENDER_INIT, _sender_takes_numpy_indices, HookType.AFTER)
    wait_ms = int(os.environ.get(PD_POLL_MS_ENV, "0") or 0)
    if wait_ms > 0:
        hooks.register(targets.SCHEDULER_ON_IDLE, _pd_poll_wait(wait_ms), HookType.AROUND)
    dp_wait_ms = int(os.environ.get(DP_WAIT_MS_ENV, "0") or 0)
    if dp_wait_ms > 0:
        hooks.register(targets.DP_CONTROLLER_EVENT_LOOP, _dp_controller_waits(dp_wait_ms),
                       HookType.AROUND)
