"""Every HookRegistry target the plugin registers: one list, each with its hook kinds and why.

A target is the dotted path of an SGLang function or method that HookRegistry wraps. The
registrations (:func:`omniinfer.sglang_plugin.hooks.register`) take a :class:`Target` from
here, never a string, and refuse a hook kind the target does not list; :data:`ALL` is what the
hook test (``test/sglang_plugin/test_hook_targets.py``) compares the registrations with and
resolves in the installed SGLang. At run time :func:`omniinfer.sglang_plugin.hooks.verify`
(scheduler start) raises for a registered target HookRegistry did not apply.

Where the hooked name is also a declared internal (its parameters are bound by name), the path
comes from :mod:`omniinfer.sglang_plugin.internals`. This module imports no SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass

from omniinfer.sglang_plugin import internals

BEFORE, AFTER, AROUND = "before", "after", "around"  # HookType values


@dataclass(frozen=True)
class Target:
    """A HookRegistry target: ``path`` (``module.Class.method`` or ``module.function``), the
    hook kinds registered on it (``HookType`` values), and why the plugin hooks it."""

    path: str
    kinds: frozenset[str]
    why: str


def _target(path: str, why: str, *kinds: str) -> Target:
    return Target(path, frozenset(kinds), why)


_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
_SERVER_ARGS = "sglang.srt.server_args.ServerArgs"
_EPLB_MANAGER = "sglang.srt.eplb.eplb_manager.EPLBManager"
_TORCH_NATIVE = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend"
_POOL_CONFIGURATOR = "sglang.srt.model_executor.pool_configurator"

# ---- launcher: omni flags and launch-time checks (server_args.py)
ADD_CLI_ARGS = _target(f"{_SERVER_ARGS}.add_cli_args", "omni flags on SGLang's parser", AFTER)
FROM_CLI_ARGS = _target(f"{_SERVER_ARGS}.from_cli_args", "omni flags validated, SGLang surface "
                        "checked, namespace prepared, CPU defaults, config exported", BEFORE)

# ---- scheduler: config, SGLang check, status, PD/CPU waits
SCHEDULER_INIT = _target(f"{_SCHEDULER}.__init__", "omni config, internals and hook check, "
                         "OmniAttn tree check and status (worker.py, omni_attn.plugin)", AFTER)
SCHEDULER_ON_IDLE = _target(f"{_SCHEDULER}.on_idle", "CPU PD: wait instead of spinning "
                            "(cpu_fixes); OmniAttn status refresh", AFTER, AROUND)
PROCESS_BATCH_RESULT = _target(f"{_SCHEDULER}.process_batch_result", "OmniAttn: free the "
                               "compressed layers' out-of-window prompt slots after prefill",
                               AFTER)

# ---- CPU engine (cpu_fixes.py)
GROUP_COORDINATOR_INIT = _target(internals.GROUP_COORDINATOR_INIT.path,
                                 "CPU: no NCCL communicator", BEFORE)
MOE_FORWARD_NATIVE = _target("sglang.srt.layers.moe.fused_moe_native.moe_forward_native",
                             "CPU EP: experts of other ranks (-1 ids) masked", AROUND)
MOONCAKE_SENDER_INIT = _target("sglang.srt.disaggregation.mooncake.conn.MooncakeKVSender"
                               ".__init__", "CPU PD: NumPy page indices, no pinned memory or "
                               "CUDA events", AFTER)
DP_CONTROLLER_EVENT_LOOP = _target(internals.DP_CONTROLLER_EVENT_LOOP.path,
                                   "CPU DP: the controller waits instead of spinning", AROUND)

# ---- OmniPlacement (placement/)
EPLB_MANAGER_INIT = _target(f"{_EPLB_MANAGER}.__init__", "SGLang's EPLB on models without "
                            "routed_experts_weights_of_layer", AFTER)
EPLB_FORWARD_PASS_END = _target(f"{_EPLB_MANAGER}.on_forward_pass_end",
                                "OmniPlacement decides instead of EPLB", AROUND)
STAT_ACCUMULATOR_APPEND = _target(internals.STAT_ACCUMULATOR_APPEND.path,
                                  "OmniPlacement activation monitor", AFTER)

# ---- OmniAttn (omni_attn/)
TORCH_NATIVE_EXTEND = _target(f"{_TORCH_NATIVE}.forward_extend",
                              "OmniAttn: compressed layers' sink + recent attention", AROUND)
TORCH_NATIVE_DECODE = _target(f"{_TORCH_NATIVE}.forward_decode",
                              "OmniAttn: compressed layers' sink + recent attention", AROUND)
EVICT_SLIDING_WINDOWS = _target(
    "sglang.srt.mem_cache.base_prefix_cache.BasePrefixCache.evict_sliding_windows",
    "OmniAttn: window frees keep the sink; freed slots counted", AROUND)
SWA_COMPONENT_FREE = _target(internals.SWA_FREE_OUT_OF_WINDOW.path,
                             "OmniAttn: the tree component's window frees keep the sink", AROUND)
ESTIMATE_SWA_TOKENS = _target(internals.ESTIMATE_SWA_TOKENS.path,
                              "OmniAttn admission: the window grows by the sink", AROUND)
SWA_REQUEST_CAP = _target(internals.SWA_REQUEST_CAP.path,
                          "OmniAttn request cap: the window grows by the sink", AROUND)
POOL_SIZES = tuple(
    _target(f"{_POOL_CONFIGURATOR}.{c}.calculate_pool_sizes_from_max_tokens",
            "OmniAttn: --max-total-tokens as a byte budget of both KV pools", AROUND)
    for c in ("HybridSWAPoolConfigurator", "SWARequestCapPoolConfigurator")
)
MAYBE_EVICT_SWA = _target("sglang.srt.managers.schedule_batch.ScheduleBatch.maybe_evict_swa",
                          "OmniAttn status refresh after window frees", AFTER)
SEND_KV_CHUNK = _target(internals.SEND_KV_CHUNK.path,
                        "OmniAttn PD prefill: the sink pages join the SWA payload", AROUND)
SEND_KV_METADATA = _target(internals.SEND_KV_METADATA.path,
                           "OmniAttn PD decode: the sink pages of the receiving slots", AROUND)

ALL: tuple[Target, ...] = (
    ADD_CLI_ARGS, FROM_CLI_ARGS, SCHEDULER_INIT, SCHEDULER_ON_IDLE, PROCESS_BATCH_RESULT,
    GROUP_COORDINATOR_INIT, MOE_FORWARD_NATIVE, MOONCAKE_SENDER_INIT, DP_CONTROLLER_EVENT_LOOP,
    EPLB_MANAGER_INIT, EPLB_FORWARD_PASS_END, STAT_ACCUMULATOR_APPEND,
    TORCH_NATIVE_EXTEND, TORCH_NATIVE_DECODE, EVICT_SLIDING_WINDOWS, SWA_COMPONENT_FREE,
    ESTIMATE_SWA_TOKENS, SWA_REQUEST_CAP, *POOL_SIZES, MAYBE_EVICT_SWA,
    SEND_KV_CHUNK, SEND_KV_METADATA,
)
