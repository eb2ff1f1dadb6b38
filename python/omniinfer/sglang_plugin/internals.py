"""Every private SGLang name the plugin relies on, declared once and checked at start-up.

HookRegistry targets are checked by :mod:`omniinfer.sglang_plugin.hooks`. Beyond them the glue
reads private attributes of SGLang objects, subclasses private SGLang methods, passes or finds
arguments by name, and loads one SGLang source file by path. An SGLang upgrade that renames one
of those would not fail at start-up by itself: an override would silently never be called, an
argument looked up by name would silently be absent. Each such name is an :class:`Internal`
below (owner, name, why); :func:`check` resolves them against the installed SGLang and raises
:class:`SGLangInternalsError` naming every one that is missing. The scheduler-init hook calls it
right before ``hooks.verify()``, so a server with a missing internal stops at start-up.

What :func:`check` proves, per :class:`Kind`:

- ``ATTRIBUTE``: ``getattr(owner, name)`` exists on the imported owner (class attribute, method
  or module global). With ``params``, those parameters appear in its signature in that order
  (the glue passes or reads them by name or by that position).
- ``INSTANCE``: an attribute set on instances. Not observable without an instance, so the check
  is on source: ``self.<name>`` is assigned (plain, augmented or annotated assignment)
  somewhere in the owner class or one of its base classes, or declared at class
  level. A rename in SGLang's source fails it; an attribute set from outside the class does
  not count (none of the declared ones is).
- ``SOURCE``: the owner is a module that the plugin reads as a file without importing its
  package (:func:`source_file`); the file exists and defines a top-level function ``name`` with
  ``params`` in that order.
- ``FIELD``: ``name`` is a field of the record ``owner`` (``ServerArgs``, a msgspec Struct in
  0.5.23; a dataclass before): the launcher writes
  it on the parsed namespace, and ``ServerArgs.from_cli_args`` silently drops a name that is no
  field. :func:`check_launch` runs these (and ``ENV``) in the launcher, before any process starts.
- ``ENV``: ``name`` is an environment variable the plugin sets or reads, and the source file of
  the module ``owner`` (where SGLang reads it) still names it.

This module imports no SGLang at import time.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import importlib.util
import inspect
import pkgutil
import re
import textwrap
from collections.abc import Collection, Iterable, Mapping
from functools import cache
from pathlib import Path
from typing import Any

# Features: which part of the plugin needs a name (start-up checks only what is switched on).
CORE, PLACEMENT, OMNI_ATTN, CPU, PEER = "core", "placement", "omni_attn", "cpu", "peer"
FEATURES = frozenset({CORE, PLACEMENT, OMNI_ATTN, CPU, PEER})


class Kind(enum.Enum):
    """How a declared name is found in the installed SGLang (see the module docstring)."""

    ATTRIBUTE = "attribute"
    INSTANCE = "instance"
    SOURCE = "source"
    FIELD = "field"
    ENV = "environment variable"


class SGLangInternalsError(RuntimeError):
    """Declared private SGLang names did not resolve in the installed SGLang."""


@dataclasses.dataclass(frozen=True)
class Internal:
    """One private SGLang name: ``owner`` (dotted path of a class, function or module),
    ``name`` (attribute, method or top-level function), why the plugin needs it, the feature
    that uses it, how it is checked, and the parameters the glue uses by name or position."""

    owner: str
    name: str
    why: str
    feature: str
    kind: Kind = Kind.ATTRIBUTE
    params: tuple[str, ...] = ()

    @property
    def path(self) -> str:
        """``owner.name``: also the HookRegistry target string where the name is hooked."""
        return f"{self.owner}.{self.name}"


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
_F = Kind.FIELD
SERVER_ARGS_FIELDS = (
    Internal(_SERVER_ARGS, "sleep_on_idle", "cpu.server_defaults sets it (an idle CPU "
             "scheduler spins without it)", CPU, _F),
    Internal(_SERVER_ARGS, "disaggregation_transfer_backend", "cpu.server_defaults: Mooncake "
             "over TCP on a CPU", CPU, _F),
    Internal(_SERVER_ARGS, "disaggregation_decode_retraction_backup", "cpu.server_defaults: "
             "retraction backups in CPU tensors", CPU, _F),
    Internal(_SERVER_ARGS, "enable_eplb", "--enable-omni-placement runs on EPLB's plumbing",
             PLACEMENT, _F),
    Internal(_SERVER_ARGS, "init_expert_location", "--omni-placement-plan: the first layout",
             PLACEMENT, _F),
    Internal(_SERVER_ARGS, "ep_size", "--enable-omni-placement needs expert parallelism",
             PLACEMENT, _F),
    Internal(_SERVER_ARGS, "model_path", "the pattern is checked against the model's config",
             OMNI_ATTN, _F),
    Internal(_SERVER_ARGS, "json_model_override_args", "the pattern's layers become SWA layers",
             OMNI_ATTN, _F),
    Internal(_SERVER_ARGS, "swa_full_tokens_ratio", "the SWA pool's share under a pattern",
             OMNI_ATTN, _F),
    Internal(_SERVER_ARGS, "radix_cache_backend", "the sink rules need the Python radix core",
             OMNI_ATTN, _F),
    Internal(_SERVER_ARGS, "max_total_tokens", "/omni_attn/status reports the KV pool", CORE,
             _F),
)
_E = Kind.ENV
ENVIRONMENT = (
    Internal("sglang.srt.environ", "SGLANG_SWA_EVICTION_INTERVAL", "omni_attn.plugin sets how "
             "often out-of-window tokens are freed", OMNI_ATTN, _E),
    Internal("sglang.srt.environ", "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX",
             "cpu.server_defaults turns early sends off on a CPU", CPU, _E),
    Internal("sglang.srt.utils.network", "SGLANG_HOST_IP", "cpu.server_defaults: the address "
             "the transfer engine advertises", CPU, _E),
    Internal("sglang.srt.platforms.__init__", "SGLANG_USE_CPU_ENGINE", "selects SGLang's CPU "
             "engine (launch.py sets it)", CPU, _E),
    Internal("sglang.srt.utils.common", "SGLANG_CPU_OMP_THREADS_BIND", "launch.py binds the "
             "CPU engine's OpenMP threads", CPU, _E),
)
RADIX_TREE_CORE = Internal(
    "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache", "tree_core",
    "omni_attn.radix asserts the Python tree core at cache creation (the Rust core would "
    "bypass every sink rule)", OMNI_ATTN, Kind.INSTANCE)
_METADATA = "sglang.srt.eplb.expert_location.ExpertLocationMetadata"
KEYWORDS = (
    Internal(_METADATA, "init_by_mapping", "placement.runtime builds the new layout's metadata "
             "(passes moe_ep_rank= by name)", PLACEMENT, params=("moe_ep_rank",)),
    Internal(_METADATA, "update", "placement.runtime switches the layout layer by layer "
             "(passes update_layer_ids= by name)", PLACEMENT, params=("update_layer_ids",)),
)

DECLARED: tuple[Internal, ...] = (
    HOOK_REGISTRY_PATCHED, EPLB_GET_MODEL, EPLB_MODEL_CONFIG, STAT_ACCUMULATOR_APPEND,
    DEEPSEEK_REBALANCE, GROUP_COORDINATOR_INIT, DP_CONTROLLER_EVENT_LOOP, DP_CONTROLLER_RECEIVER,
    SEND_KV_CHUNK, SEND_KV_METADATA,
    ESTIMATE_SWA_TOKENS, SWA_REQUEST_CAP,
    *POOL_CONFIGURATOR_FIELDS, TRITON_SET_KV_BUFFER, *RADIX_INTERNALS,
    *SERVER_ARGS_FIELDS, *ENVIRONMENT, *KEYWORDS, RADIX_TREE_CORE,
)


def start_up_features(*, placement: bool, omni_attn: bool, cpu_engine: bool) -> frozenset[str]:
    """The features a scheduler with these switches uses (the comparison peer is never one)."""
    on = {CORE}
    on |= {PLACEMENT} if placement else set()
    on |= {OMNI_ATTN} if omni_attn else set()
    on |= {CPU} if cpu_engine else set()
    return frozenset(on)


# ---------------------------------------------------------------- checks


def _ordered(have: Iterable[str], want: tuple[str, ...]) -> str | None:
    """None when every name of ``want`` is in ``have`` in that order; else what is wrong."""
    names = list(have)
    missing = [p for p in want if p not in names]
    if missing:
        return f"no parameter {', '.join(missing)}"
    positions = [names.index(p) for p in want]
    if positions != sorted(positions):
        return f"parameters {', '.join(want)} are no longer in this order"
    return None


@cache
def _self_assigned(klass: type) -> frozenset[str]:
    """Names assigned on ``self`` anywhere in the source of ``klass`` (empty without source)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
    except (OSError, TypeError, SyntaxError):
        return frozenset()
    return frozenset(
        node.attr for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Name) and node.value.id == "self"
    )


def _assigned_on_self(cls: type, name: str) -> bool:
    """``self.<name>`` is assigned in the source of ``cls`` or a base, or declared on a class."""
    for klass in inspect.getmro(cls):
        if klass is object:
            continue
        if name in vars(klass) or name in vars(klass).get("__annotations__", {}):
            return True
        if name in _self_assigned(klass):
            return True
    return False


def source_file(decl: Internal) -> Path:
    """The file of ``decl.owner`` inside the installed package, found without importing it
    (FileNotFoundError when the package or the file is absent)."""
    top, *rest = decl.owner.split(".")
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {top} is not installed")
    path = Path(next(iter(spec.submodule_search_locations))).joinpath(*rest).with_suffix(".py")
    if not path.is_file():
        raise FileNotFoundError(f"{'/'.join(rest)}.py is not in the installed {top}")
    return path


def _source_problem(decl: Internal) -> str | None:
    try:
        tree = ast.parse(source_file(decl).read_text())
    except (OSError, SyntaxError) as exc:
        return str(exc)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == decl.name:
            args = node.args
            return _ordered([a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)],
                            decl.params)
    return f"no top-level function {decl.name}"


def _named_in_source(decl: Internal) -> str | None:
    try:
        text = source_file(decl).read_text()
    except OSError as exc:
        return str(exc)
    return None if re.search(rf"\b{re.escape(decl.name)}\b", text) else "no longer read there"


def _record_fields(owner: Any) -> frozenset[str] | None:
    """The fields ``ServerArgs.from_cli_args`` keeps (it reads them the same way: a msgspec
    Struct's, else a dataclass's); None for another kind of class."""
    try:
        import msgspec

        if isinstance(owner, type) and issubclass(owner, msgspec.Struct):
            return frozenset(f.name for f in msgspec.structs.fields(owner))
    except ImportError:
        pass
    if dataclasses.is_dataclass(owner):
        return frozenset(f.name for f in dataclasses.fields(owner))
    return None


def problem(decl: Internal) -> str | None:
    """Why ``decl`` does not hold in the installed SGLang; None when it does."""
    if decl.kind is Kind.SOURCE:
        return _source_problem(decl)
    if decl.kind is Kind.ENV:
        return _named_in_source(decl)
    try:
        owner = pkgutil.resolve_name(decl.owner)
    except (ImportError, AttributeError, ValueError) as exc:
        return f"owner does not resolve ({type(exc).__name__}: {exc})"
    if decl.kind is Kind.INSTANCE:
        if not isinstance(owner, type):
            return "owner is not a class"
        return None if _assigned_on_self(owner, decl.name) else "never assigned on self"
    if decl.kind is Kind.FIELD:
        fields = _record_fields(owner)
        if fields is None:
            return "owner is neither a msgspec Struct nor a dataclass"
        return None if decl.name in fields else "no such field (a value set there is dropped)"
    if not hasattr(owner, decl.name):
        return "no such attribute"
    if not decl.params:
        return None
    try:
        parameters = inspect.signature(getattr(owner, decl.name)).parameters
    except (TypeError, ValueError) as exc:
        return f"no signature ({exc})"
    return _ordered(parameters, decl.params)


def missing(declared: Iterable[Internal] | None = None,
            features: Collection[str] | None = None) -> list[tuple[Internal, str]]:
    """(declaration, problem) for each declared name (all, or those of ``features``) that
    does not hold."""
    pool = DECLARED if declared is None else tuple(declared)
    chosen = [d for d in pool if features is None or d.feature in features]
    return [(d, p) for d in chosen if (p := problem(d)) is not None]


def check(features: Collection[str] | None = None,
          declared: Iterable[Internal] | None = None) -> None:
    """Raise :class:`SGLangInternalsError` naming every declared name (of ``features``; all
    when None) that the installed SGLang lacks; return None when all hold."""
    found = missing(declared, features)
    if found:
        lines = [f"  {d.path} [{d.kind.value}]: {p}  ({d.why})" for d, p in found]
        raise SGLangInternalsError(
            "omniinfer: these private SGLang names the plugin relies on are missing or changed "
            "in this SGLang version, so the behaviour that needs them would break:\n"
            + "\n".join(lines)
        )


def check_launch(features: Collection[str]) -> None:
    """The launcher's check (before any process starts): the ``ServerArgs`` fields it writes
    and the environment variables it sets, of ``features``."""
    check(features, [d for d in DECLARED if d.kind in (Kind.FIELD, Kind.ENV)])


# ---------------------------------------------------------------- use


@cache
def signature(decl: Internal) -> inspect.Signature:
    """The signature of the declared callable (of the original where HookRegistry wrapped it:
    its wrappers carry ``__wrapped__``)."""
    return inspect.signature(getattr(pkgutil.resolve_name(decl.owner), decl.name))


def bind(decl: Internal, args: tuple[Any, ...], kwargs: Mapping[str, Any]
         ) -> inspect.BoundArguments:
    """The call ``decl(*args, **kwargs)`` bound to parameter names (``self`` included for a
    method: pass the instance first). Partial: parameters the call leaves out stay absent from
    ``arguments``; TypeError when the call does not fit the signature."""
    return signature(decl).bind_partial(*args, **kwargs)


def replace_argument(decl: Internal, args: tuple[Any, ...], kwargs: Mapping[str, Any],
                     name: str, value: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` of the same call with parameter ``name`` (declared in
    ``decl.params``) set to ``value``; the call is normalised by the signature (an argument goes
    by position while every parameter before it is given, by keyword after a gap)."""
    assert name in decl.params, f"{name} is not declared for {decl.path}"
    bound = bind(decl, args, kwargs)
    bound.arguments[name] = value
    return bound.args, dict(bound.kwargs)

