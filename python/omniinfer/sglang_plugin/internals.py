"""Every SGLang name the plugin relies on beyond hook targets, declared once and checked.

HookRegistry targets are listed in :mod:`omniinfer.sglang_plugin.targets` and checked by
:mod:`omniinfer.sglang_plugin.hooks`. Beyond them the glue reads private attributes of SGLang
objects, subclasses private SGLang methods, passes or finds arguments by name, reads and writes
``ServerArgs`` fields on the launcher's parsed namespace, sets environment variables SGLang
reads, and loads one SGLang source file by path. An SGLang upgrade that renames one of those
would not fail by itself: an override would silently never be called, an argument looked up by
name would silently be absent, a field written on the namespace would be dropped, a refusal
read through ``getattr(namespace, name, default)`` would silently pass. Each such name is an
:class:`Internal` below (owner, name, why, feature, :class:`Kind`); how each kind is checked is
:mod:`omniinfer.sglang_plugin.checking`.

Two checks run them, each for the features switched on:

- :func:`check_launch`, in the launcher (the ``ServerArgs.from_cli_args`` hook), before the
  namespace is read or written and before any process starts: every ``FIELD`` and ``ENV``;
- :func:`check`, at scheduler start (the ``Scheduler.__init__`` hook, right before
  ``hooks.verify()``): every kind, keyword parameters included.

Either raises :class:`SGLangInternalsError` naming every declaration that does not hold.
Tests monkeypatch :data:`DECLARED` (read at call time) to check a renamed copy of the table.
This module imports no SGLang at import time.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from omniinfer.sglang_plugin.checking import Internal as Internal
from omniinfer.sglang_plugin.checking import Kind as Kind
from omniinfer.sglang_plugin.checking import SGLangInternalsError as SGLangInternalsError
from omniinfer.sglang_plugin.checking import bind as bind
from omniinfer.sglang_plugin.checking import problem as problem
from omniinfer.sglang_plugin.checking import raise_missing
from omniinfer.sglang_plugin.checking import replace_argument as replace_argument
from omniinfer.sglang_plugin.checking import signature as signature
from omniinfer.sglang_plugin.checking import source_file as source_file

# Features: which part of the plugin needs a name (start-up checks only what is switched on).
CORE, PLACEMENT, OMNI_ATTN, CPU, PEER = "core", "placement", "omni_attn", "cpu", "peer"
FEATURES = frozenset({CORE, PLACEMENT, OMNI_ATTN, CPU, PEER})

_HOOK_REGISTRY = "sglang.srt.plugins.hook_registry.HookRegistry"
_EPLB_MANAGER = "sglang.srt.eplb.eplb_manager.EPLBManager"
_STAT_ACCUMULATOR = "sglang.srt.eplb.expert_distribution._StatAccumulator"
_GROUP_COORDINATOR = "sglang.srt.distributed.parallel_state.GroupCoordinator"
_SWA_COMPONENT = "sglang.srt.mem_cache.unified_cache.components.swa.SWAComponent"
_TREE_CORE = "sglang.srt.mem_cache.unified_cache.unified_tree_core.UnifiedTreeCore"
_TREE_COMPONENT = "sglang.srt.mem_cache.unified_cache.components.base.TreeComponent"
_FULL_COMPONENT = "sglang.srt.mem_cache.unified_cache.components.full.FullComponent"
_TRITON_BACKEND = "sglang.srt.layers.attention.triton_backend.TritonAttnBackend"
_CONFIGURATORS = (
    "sglang.srt.model_executor.pool_configurator.HybridSWAPoolConfigurator",
    "sglang.srt.model_executor.pool_configurator.SWARequestCapPoolConfigurator",
)
_I, _S = Kind.INSTANCE, Kind.SOURCE

# ---- shared glue
HOOK_REGISTRY_PATCHED = Internal(_HOOK_REGISTRY, "_patched",
                                 "hooks.unapplied: the targets HookRegistry applied", CORE)

# ---- OmniPlacement
EPLB_GET_MODEL = Internal(_EPLB_MANAGER, "_get_model",
                          "PlacementController and the EPLB adapter: the model whose expert "
                          "weights move", CORE, _I)
EPLB_MODEL_CONFIG = Internal(_EPLB_MANAGER, "_model_config",
                             "PlacementController: ExpertLocationMetadata of a new layout",
                             PLACEMENT, _I)
STAT_ACCUMULATOR_APPEND = Internal(
    _STAT_ACCUMULATOR, "append", "placement hooks: the per-pass counts (hooked, read by name)",
    PLACEMENT, params=("single_pass_data",))
DEEPSEEK_REBALANCE = Internal(
    "sglang.srt.eplb.eplb_algorithms.deepseek", "rebalance_experts",
    "placement.peer: SGLang's EPLB algorithm as the comparison peer (file loaded by path)", PEER,
    _S, params=("weight", "num_replicas", "num_groups", "num_nodes", "num_gpus",
                "enable_hierarchical"))

# ---- CPU engine
GROUP_COORDINATOR_INIT = Internal(
    _GROUP_COORDINATOR, "__init__", "cpu_fixes: use_pynccl switched off (hooked, set by name)",
    CPU, params=("use_pynccl",))
_DP_CONTROLLER = "sglang.srt.managers.data_parallel_controller.DataParallelController"
DP_CONTROLLER_EVENT_LOOP = Internal(
    _DP_CONTROLLER, "event_loop", "cpu_fixes: the DP controller waits instead of spinning (hooked)",
    CPU)
DP_CONTROLLER_RECEIVER = Internal(
    _DP_CONTROLLER, "recv_from_tokenizer",
    "cpu_fixes: the socket whose non-blocking receive the DP controller spins on", CPU, Kind.INSTANCE)

# ---- OmniAttn under PD (hooked private methods; the hooks call them by these positions)
SEND_KV_CHUNK = Internal(
    "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin", "_send_kv_chunk",
    "OmniAttn PD prefill: the sink pages join the SWA payload", OMNI_ATTN,
    params=("req", "last_chunk", "end_idx"))
SEND_KV_METADATA = Internal(
    "sglang.srt.disaggregation.decode.DecodePreallocQueue", "_send_kv_metadata",
    "OmniAttn PD decode: the sink pages of the receiving slots", OMNI_ATTN,
    params=("decode_req", "kv_indices", "page_size", "state_indices"))

# ---- OmniAttn: admission arithmetic (hooked functions, keyword read by name)
ESTIMATE_SWA_TOKENS = Internal(
    "sglang.srt.mem_cache.prefill_budget", "estimate_swa_kv_tokens",
    "OmniAttn admission: the window grows by the sink", OMNI_ATTN,
    params=("sliding_window_size",))
SWA_REQUEST_CAP = Internal(
    "sglang.srt.model_executor.pool_configurator", "compute_swa_request_cap",
    "OmniAttn request cap: the window grows by the sink", OMNI_ATTN, params=("window",))

# ---- OmniAttn: the byte budget of --max-total-tokens (pool configurator fields)
POOL_CONFIGURATOR_FIELDS = tuple(
    Internal(c, f, "OmniAttn --max-total-tokens as a byte budget of both KV pools", OMNI_ATTN, _I)
    for c in _CONFIGURATORS
    for f in ("_full_layers_num", "_swa_layers_num", "_full_per_token", "_swa_per_token")
)

# ---- OmniAttn: the attention backend omni_triton (TritonAttnBackend subclass)
TRITON_SET_KV_BUFFER = Internal(
    _TRITON_BACKEND, "_set_kv_buffer", "omni_triton: K/V written by SGLang's own write path",
    OMNI_ATTN, params=("forward_batch", "layer", "loc_info", "k", "v", "k_scale", "v_scale"))

# ---- OmniAttn: the sink-aware radix tree (SWAComponent subclass, the Python tree core)
_WHY_OVERRIDE = "SinkSWAComponent overrides it (a rename would bypass the sink rules)"
_WHY_CALLED = "SinkSWAComponent calls it"
_WHY_CORE = "SinkSWAComponent splits nodes / walks the tree core"
_WHY_PIN = "SinkFullComponent overrides it (a full lock pins the path's sink nodes)"
SWA_FREE_OUT_OF_WINDOW = Internal(
    _SWA_COMPONENT, "_free_out_of_window_slots",
    "hooked (sink floor) and overridden by SinkSWAComponent", OMNI_ATTN, params=("req", "pre_len"))
RADIX_INTERNALS: tuple[Internal, ...] = (
    SWA_FREE_OUT_OF_WINDOW,
    Internal(_SWA_COMPONENT, "_populate_range", _WHY_OVERRIDE, OMNI_ATTN,
             params=("node", "start", "end", "params", "result", "cap_leaf", "cache_actions")),
    Internal(_SWA_COMPONENT, "_evict_device_next_node", _WHY_OVERRIDE, OMNI_ATTN,
             params=("tracker", "device_frees", "host_frees", "cache_actions")),
    Internal(_SWA_COMPONENT, "create_match_validator", _WHY_OVERRIDE, OMNI_ATTN,
             params=("match_device_only",)),
    Internal(_SWA_COMPONENT, "update_component_on_insert_overlap", _WHY_OVERRIDE, OMNI_ATTN,
             params=("node", "prefix_len", "total_prefix_len", "value_slice", "params",
                     "result", "cache_actions")),
    Internal(_SWA_COMPONENT, "release_window_lock", _WHY_OVERRIDE, OMNI_ATTN,
             params=("node", "swa_uuid_for_lock", "device_frees", "host_frees",
                     "cache_actions")),
    Internal(_SWA_COMPONENT, "_evict_device_start", _WHY_OVERRIDE, OMNI_ATTN,
             params=("request_cnt",)),
    Internal(_SWA_COMPONENT, "acquire_component_lock", _WHY_OVERRIDE, OMNI_ATTN,
             params=("node", "result", "lock_host")),
    Internal(_SWA_COMPONENT, "sliding_window_size", "SinkSWAComponent: where the lock ends",
             OMNI_ATTN, _I),
    Internal(_SWA_COMPONENT, "redistribute_on_node_split", _WHY_OVERRIDE, OMNI_ATTN,
             params=("new_parent", "child")),
    Internal(_FULL_COMPONENT, "acquire_component_lock", _WHY_PIN, OMNI_ATTN,
             params=("node", "result", "lock_host")),
    Internal(_FULL_COMPONENT, "release_component_lock", _WHY_PIN, OMNI_ATTN,
             params=("node", "params", "lock_host")),
    Internal(_TREE_COMPONENT, "reclaimable_value_len", _WHY_CALLED, OMNI_ATTN, params=("node",)),
    Internal(_SWA_COMPONENT, "_segments", _WHY_CALLED, OMNI_ATTN, params=("node", "start", "end")),
    Internal(_SWA_COMPONENT, "_publish_window", _WHY_CALLED, OMNI_ATTN,
             params=("node", "cache_actions")),
    Internal(_SWA_COMPONENT, "_evict_device_cursor", "SinkSWAComponent: the eviction walk",
             OMNI_ATTN, _I),
    Internal(_SWA_COMPONENT, "_evict_device_request_cnt", "SinkSWAComponent: the eviction walk",
             OMNI_ATTN, _I),
    Internal(_TREE_COMPONENT, "tree_core", "SinkSWAComponent: its tree", OMNI_ATTN, _I),
    Internal(_TREE_CORE, "_split_node", _WHY_CORE, OMNI_ATTN, params=("key", "child", "split_len")),
    Internal(_TREE_CORE, "_update_evictable_leaf_sets", _WHY_CORE, OMNI_ATTN, params=("node",)),
    Internal(_TREE_CORE, "_is_device_leaf", _WHY_CORE, OMNI_ATTN, params=("node",)),
    Internal(_TREE_CORE, "_evict_component_and_detach_lru", _WHY_CORE, OMNI_ATTN,
             params=("node", "comp", "device_frees", "host_frees", "cache_actions", "target")),
    *(Internal(_TREE_CORE, f, _WHY_CORE, OMNI_ATTN, _I)
      for f in ("root_node", "lru_lists", "evictable_device_leaves", "components_by_type",
                "component_protected_size_", "component_evictable_size_")),
)

_SERVER_ARGS = "sglang.srt.server_args.ServerArgs"


def _fields(feature: str, why: str, *names: str) -> tuple[Internal, ...]:
    """One ``ServerArgs`` FIELD declaration per name, all needed for the same reason."""
    return tuple(Internal(_SERVER_ARGS, n, why, feature, Kind.FIELD) for n in names)


# ---- ServerArgs fields read or written on the launcher's namespace (checked at launch)
RADIX_CONFLICT_FIELDS = _fields(
    OMNI_ATTN, "omni_attn.plugin refuses each (it swaps the tree cache or its core for one "
    "without the sink rules); the flag is --<name with dashes>", "enable_hierarchical_cache",
    "enable_lmcache", "enable_session_radix_cache", "enable_streaming_session")
SERVER_ARGS_FIELDS = (
    *_fields(CORE, "/omni/attn reports it; OmniAttn balances its pools for it",
             "max_total_tokens"),
    *_fields(CORE, "OmniAttn's PD refusals and the CPU PD defaults read it",
             "disaggregation_mode"),
    *_fields(OMNI_ATTN, "the pattern is checked against the model's config", "model_path"),
    *_fields(OMNI_ATTN, "refused unless a backend that serves compressed layers",
             "attention_backend", "prefill_attention_backend", "decode_attention_backend"),
    *_fields(OMNI_ATTN, "a page size above 1 is refused on torch_native and under PD",
             "page_size"),
    *_fields(OMNI_ATTN, "refused with a pattern", "disable_hybrid_swa_memory",
             "speculative_algorithm", "disaggregation_decode_enable_radix_cache"),
    *_fields(OMNI_ATTN, "the pattern's layers become SWA layers (read, then written)",
             "json_model_override_args"),
    *_fields(OMNI_ATTN, "the SWA pool's share under a pattern: written unless the user set "
             "it or a request cap; balanced for the prefill chunk", "swa_full_tokens_ratio",
             "max_running_requests", "chunked_prefill_size"),
    *_fields(OMNI_ATTN, "prefix reuse through the sink-aware tree unless the user turned the "
             "radix cache off", "disable_radix_cache"),
    *_fields(OMNI_ATTN, "written omni_attn (the sink rules); another backend is refused",
             "radix_cache_backend"),
    *RADIX_CONFLICT_FIELDS,
    *_fields(PLACEMENT, "--enable-omni-placement runs on EPLB's plumbing", "enable_eplb"),
    *_fields(PLACEMENT, "--omni-placement-plan: the first layout", "init_expert_location"),
    *_fields(PLACEMENT, "--enable-omni-placement needs expert parallelism", "ep_size"),
    *_fields(CPU, "cpu.server_defaults sets it (an idle CPU scheduler spins without it)",
             "sleep_on_idle"),
    *_fields(CPU, "cpu.server_defaults: the DP controller's wait with --dp-size > 1",
             "dp_size"),
    *_fields(CPU, "cpu.server_defaults: a server on loopback advertises loopback", "host"),
    *_fields(CPU, "cpu.server_defaults: Mooncake over TCP on a CPU",
             "disaggregation_transfer_backend"),
    *_fields(CPU, "cpu.server_defaults: retraction backups in CPU tensors",
             "disaggregation_decode_retraction_backup"),
)

# ---- environment variables the plugin or its launchers set or name (checked at launch)
_E = Kind.ENV
ENVIRONMENT = (
    Internal("sglang.srt.environ", "SGLANG_SWA_EVICTION_INTERVAL", "omni_attn.plugin sets how "
             "often out-of-window tokens are freed", OMNI_ATTN, _E),
    Internal("sglang.srt.environ", "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", "omni_attn.radix "
             "names it when the Rust tree core was chosen (the error's fix)", OMNI_ATTN, _E),
    Internal("sglang.srt.environ", "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX",
             "cpu.server_defaults turns early sends off on a CPU", CPU, _E),
    Internal("sglang.srt.utils.network", "SGLANG_HOST_IP", "cpu.server_defaults: the address "
             "the transfer engine advertises", CPU, _E),
    Internal("sglang.srt.utils.network", "HOST_IP", "cpu.server_defaults leaves the address "
             "alone when the user set SGLang's fallback variable", CPU, _E),
    Internal("sglang.srt.platforms.__init__", "SGLANG_USE_CPU_ENGINE", "selects SGLang's CPU "
             "engine (cpu.server_env sets it)", CPU, _E),
    Internal("sglang.srt.utils.common", "SGLANG_CPU_OMP_THREADS_BIND", "cpu.server_env binds "
             "the CPU engine's OpenMP threads", CPU, _E),
)

# ---- instance attributes of scheduler-side objects the glue reads by name
_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
_RADIX_CACHE = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache"
_REQ = "sglang.srt.managers.schedule_batch.Req"
RADIX_TREE_CORE = Internal(
    _RADIX_CACHE, "tree_core", "omni_attn.radix asserts the Python tree core at cache creation "
    "and at scheduler start (the Rust core would bypass every sink rule)", OMNI_ATTN, _I)
RADIX_COMPONENTS = Internal(
    _RADIX_CACHE, "components", "omni_attn.radix: the sink components are the tree's, checked "
    "at scheduler start", OMNI_ATTN, _I)
SCHEDULER_TREE_CACHE = Internal(
    _SCHEDULER, "tree_cache", "OmniAttn: the start-up tree check, frees after prefill and after "
    "a PD transfer, status", OMNI_ATTN, _I)
SCHEDULER_RADIX_OFF = Internal(
    _SCHEDULER, "disable_radix_cache", "OmniAttn start-up tree check: a radix cache that is "
    "off caches nothing", OMNI_ATTN, _I)
SCHEDULER_SERVER_ARGS = Internal(
    _SCHEDULER, "server_args", "omni_attn.status: --max-total-tokens", OMNI_ATTN, _I)
SCHEDULER_PD_MODE = Internal(
    _SCHEDULER, "disaggregation_mode", "OmniAttn PD frees and the CPU PD wait", CORE, _I)
SCHEDULER_IDLE_SLEEPER = Internal(
    _SCHEDULER, "idle_sleeper", "cpu_fixes: the PD wait polls its sockets", CPU, _I)
IDLE_SLEEPER_POLLER = Internal(
    "sglang.srt.managers.scheduler_components.idle_sleeper.IdleSleeper", "poller",
    "cpu_fixes: the sockets the PD wait polls (the Rust server's sleeper has none, so the wait "
    "sleeps there)", CPU, _I)
REQ_KV_SENDER = Internal(_REQ, "disagg_kv_sender", "omni_attn.pd: the prefill sender the sink "
                         "pages join (None without PD)", OMNI_ATTN, _I)
REQ_DECODE_PREFIX = Internal(_REQ, "disagg_decode_prefix_len", "omni_attn.pd: where the sink "
                             "span starts on the prefill side", OMNI_ATTN, _I)
SCHEDULER_STATE: tuple[Internal, ...] = (
    RADIX_TREE_CORE, RADIX_COMPONENTS, SCHEDULER_TREE_CACHE, SCHEDULER_RADIX_OFF,
    SCHEDULER_SERVER_ARGS, SCHEDULER_PD_MODE, SCHEDULER_IDLE_SLEEPER, IDLE_SLEEPER_POLLER,
    REQ_KV_SENDER, REQ_DECODE_PREFIX,
)

# ---- keyword arguments passed or read by name (checked at scheduler start)
_METADATA = "sglang.srt.eplb.expert_location.ExpertLocationMetadata"
RECEIVER_SEND_METADATA = Internal(
    "sglang.srt.disaggregation.base.conn.BaseKVReceiver", "send_metadata",
    "omni_attn.pd reads decode_prefix_len= from the keywords of the hooked _send_kv_metadata, "
    "which SGLang passes on to this", OMNI_ATTN, params=("decode_prefix_len",))
KEYWORDS = (
    Internal(_METADATA, "init_by_mapping", "placement.runtime builds the new layout's metadata "
             "(passes moe_ep_rank= by name)", PLACEMENT, params=("moe_ep_rank",)),
    Internal(_METADATA, "update", "placement.runtime switches the layout layer by layer "
             "(passes update_layer_ids= by name)", PLACEMENT, params=("update_layer_ids",)),
    RECEIVER_SEND_METADATA,
)
GET_PARALLEL = Internal("sglang.srt.runtime_context", "get_parallel",
                        "ranks.tp_rank: this scheduler's tensor-parallel rank", CORE)

DECLARED: tuple[Internal, ...] = (
    HOOK_REGISTRY_PATCHED, EPLB_GET_MODEL, EPLB_MODEL_CONFIG, STAT_ACCUMULATOR_APPEND,
    DEEPSEEK_REBALANCE, GROUP_COORDINATOR_INIT, DP_CONTROLLER_EVENT_LOOP, DP_CONTROLLER_RECEIVER,
    SEND_KV_CHUNK, SEND_KV_METADATA,
    ESTIMATE_SWA_TOKENS, SWA_REQUEST_CAP,
    *POOL_CONFIGURATOR_FIELDS, TRITON_SET_KV_BUFFER, *RADIX_INTERNALS,
    *SERVER_ARGS_FIELDS, *ENVIRONMENT, *SCHEDULER_STATE, *KEYWORDS, GET_PARALLEL,
)


def start_up_features(*, placement: bool, omni_attn: bool, cpu_engine: bool) -> frozenset[str]:
    """The features a scheduler with these switches uses (the comparison peer is never one)."""
    on = {CORE}
    on |= {PLACEMENT} if placement else set()
    on |= {OMNI_ATTN} if omni_attn else set()
    on |= {CPU} if cpu_engine else set()
    return frozenset(on)


# ---------------------------------------------------------------- checks


def missing(declared: Iterable[Internal] | None = None,
            features: Collection[str] | None = None) -> list[tuple[Internal, str]]:
    """(declaration, problem) for each declared name (all of :data:`DECLARED`, or
    ``declared``; of every feature, or of ``features``) that does not hold."""
    pool = DECLARED if declared is None else tuple(declared)
    chosen = [d for d in pool if features is None or d.feature in features]
    return [(d, p) for d in chosen if (p := problem(d)) is not None]


def check(features: Collection[str] | None = None,
          declared: Iterable[Internal] | None = None) -> None:
    """Raise :class:`SGLangInternalsError` naming every declared name (of ``features``; all
    when None) that the installed SGLang lacks; return None when all hold."""
    raise_missing(missing(declared, features))


LAUNCH_KINDS = (Kind.FIELD, Kind.ENV)


def check_launch(features: Collection[str]) -> None:
    """The launcher's check (before any process starts): the ``ServerArgs`` fields it reads or
    writes and the environment variables it sets or names, of ``features``."""
    check(features, [d for d in DECLARED if d.kind in LAUNCH_KINDS])
