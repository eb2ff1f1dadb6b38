"""``--radix-cache-backend omni_attn``: SGLang's unified radix cache with a sink-aware SWA part.

SGLang 0.5.23 caches hybrid sliding-window models in ``UnifiedRadixCache`` with an
``SWAComponent``: a node's compressed (SWA) KV may be dropped while its full KV stays (a
tombstone), and a match is accepted where the ``window`` tokens above it are alive. OmniAttn
layers also read the first ``sink`` tokens, which SGLang knows nothing of. This module is the
one place that teaches the tree about them, through SGLang's supported extension points
(``register_radix_cache_backend`` and a component override, which also selects the Python
tree core: HookRegistry patches on components would be bypassed by the Rust core):

- insert (``_populate_range``): a new node is split at the sink before SGLang stores it, and
  its sink positions are stored live, not as tombstones (SGLang would leave those slots owned
  by no node);
- insert over existing nodes (``update_component_on_insert_overlap``): a duplicate sink whose
  compressed slots are still the request's is freed on both sides (SGLang frees below the
  request's eviction cursor on the full side only, leaking the sink's compressed slots);
- evict (``_evict_device_next_node``, ``release_window_lock``): a node holding a sink
  position never loses its compressed KV alone, only with its full KV when the node leaves
  the tree, which a running request's full lock on its path forbids; a longer node is split
  at the sink first so that the rest may go; an unlocked sink node goes with its subtree,
  leaf by leaf (its compressed KV counts as evictable, so the walk must be able to free it);
- lock (:class:`SinkFullComponent`, ``redistribute_on_node_split``): SGLang's window lock
  covers only the last ``window`` tokens of a request's path, so the sink nodes above it
  would count as evictable while the request runs, although nothing may free them; admission
  adds the evictable ledger to the free pool, over-admits and the allocation after eviction
  fails. Every full lock therefore also pins the sink nodes of its path (an SWA lock held as
  long as the full one), and a split hands the pins to the half that still holds the sink;
- window lock (``acquire_component_lock``): the node where the window ends is split there, so
  the lock holds one window, not the rest of a long node above a short last chunk;
- match (``create_match_validator``): a boundary is refused below a dead sink node.

The rules themselves are :mod:`omniinfer.attn.radix_sink`, tested without SGLang. Every
private SGLang name used here (the overridden and called methods, the tree core's fields) is
declared in ``internals.RADIX_INTERNALS`` and checked at scheduler start-up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from sglang.srt.mem_cache.unified_cache.cache_action import FreeComponentDeviceSlot
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_cache.components.full import FullComponent
from sglang.srt.mem_cache.unified_cache.components.swa import SWAComponent

from omniinfer.attn import radix_sink

BACKEND_NAME = "omni_attn"
_PINS = "omni_sink_pins"  # SWA metadata: full locks that pin this sink node


@dataclass
class SinkStats:
    """What the sink rules did; published in ``/omni/attn`` so tests see they ran."""

    sink_nodes_stored: int = 0  # insert: sink fragments stored live
    duplicate_sink_slots_freed: int = 0  # insert overlap: request's sink slots freed
    sink_evictions_refused: int = 0  # evict walk: sink nodes skipped
    sink_splits: int = 0  # evict walk: nodes split at the sink
    sink_subtree_leaves: int = 0  # evict walk: leaves evicted so that a sink may go
    sink_pins: int = 0  # lock: sink nodes pinned by a full lock
    window_splits: int = 0  # lock: nodes split where the locked window ends
    matches_refused: int = 0  # match: boundaries refused for a dead sink


class _Config:
    sink: int = 0
    stats = SinkStats()


def configure(sink: int) -> SinkStats:
    """Set the pattern's sink for components built from now on; returns the shared stats."""
    _Config.sink = sink
    _Config.stats = SinkStats()
    return _Config.stats


def stats() -> dict[str, int]:
    return asdict(_Config.stats)


def _start(node: Any) -> int:
    """Position of a node's first token: the lengths of its ancestors' keys."""
    depth, cur = 0, node.parent
    while cur is not None and cur.parent is not None:
        depth += len(cur.key)
        cur = cur.parent
    return depth


class SinkSWAComponent(SWAComponent):
    """SGLang's SWA tree component, plus the sink (see the module docstring)."""

    def __init__(self, cache: Any, params: Any) -> None:
        super().__init__(cache, params)
        self.sink = _Config.sink
        self.sink_stop = radix_sink.sink_end(self.sink, params.page_size)
        self.stats = _Config.stats

    def _holds_sink(self, node: Any) -> bool:
        return node is not self.tree_core.root_node and radix_sink.holds_sink(
            _start(node), self.sink_stop
        )

    # ---- lock: a full lock pins the sink nodes of its path

    def _sink_nodes(self, node: Any) -> list[Any]:
        """The nodes of ``node``'s root path that hold a sink position (its top)."""
        root, path, cur = self.tree_core.root_node, [], node
        while cur is not None and cur is not root:
            path.append(cur)
            cur = cur.parent
        held, start = [], 0
        for x in reversed(path):
            if not radix_sink.holds_sink(start, self.sink_stop):
                break
            held.append(x)
            start += len(x.key)
        return held

    def _shift_lock(self, node: Any, delta: int) -> None:
        """Add ``delta`` to the node's SWA lock, moving its size between the ledgers as
        SGLang's own lock does when the count leaves or reaches zero."""
        ct, core = self.component_type, self.tree_core
        cd = node.component_data[ct]
        before, after = cd.lock_ref, cd.lock_ref + delta
        assert after >= 0, f"sink pin release hit lock_ref=0 on node {node.id}"
        if cd.value is not None and (before == 0) != (after == 0):
            size = self.reclaimable_value_len(node) * (1 if before == 0 else -1)
            core.component_evictable_size_[ct] -= size
            core.component_protected_size_[ct] += size
        cd.lock_ref = after
        core._update_evictable_leaf_sets(node)

    def pin_sink(self, node: Any, delta: int) -> None:
        """A full lock on ``node``'s path taken (``delta`` 1) or released (-1). Insert
        splits nodes at the sink, so the pinned nodes hold nothing past it."""
        ct = self.component_type
        for x in self._sink_nodes(node):
            meta = x.component_data[ct].metadata
            pins = meta.get(_PINS, 0) + delta
            assert pins >= 0, f"sink pin released twice on node {x.id}"
            self._shift_lock(x, delta)
            meta[_PINS] = pins
            self.stats.sink_pins += max(delta, 0)

    def acquire_component_lock(self, node: Any, result: Any, lock_host: bool = False) -> Any:
        """SGLang's window lock, after splitting the node where the window ends so that the
        lock covers the window and not the whole of that node (a short last chunk would
        otherwise lock most of the chunk before it: up to twice the window per request)."""
        if not lock_host:
            self._split_at_window(node)
        return super().acquire_component_lock(node, result, lock_host)

    def _split_at_window(self, node: Any) -> None:
        """Split the node of ``node``'s path in which the last ``sliding_window_size``
        tokens begin, at that point (page-rounded); tombstones and nodes a split would owe
        SGLang a cache action for are left whole."""
        root, ct, page = self.tree_core.root_node, self.component_type, self.tree_core.page_size
        covered, cur = 0, node
        while cur is not root and covered < self.sliding_window_size:
            need = -(-(self.sliding_window_size - covered) // page) * page
            if len(cur.key) > need:
                if (cur.component_data[ct].value is not None
                        and cur.write_through_pending_id is None
                        and not self.tree_core.is_host_memory_buffer_only):
                    _, action = self.tree_core._split_node(cur.key, cur, len(cur.key) - need)
                    assert action is None, action
                    self.stats.window_splits += 1
                return
            covered += len(cur.key)
            cur = cur.parent

    def redistribute_on_node_split(self, new_parent: Any, child: Any) -> None:
        super().redistribute_on_node_split(new_parent, child)  # copies the lock to new_parent
        meta = child.component_data[self.component_type].metadata
        pins = meta.get(_PINS, 0)
        if pins:
            new_parent.component_data[self.component_type].metadata[_PINS] = pins
            if not self._holds_sink(child):  # the sink went up with new_parent
                del meta[_PINS]
                self._shift_lock(child, -pins)

    # ---- the request's own window eviction: never below the sink

    def _free_out_of_window_slots(self, req: Any, pre_len: int) -> None:
        if req.kv.holds_kv and req.kv.swa_evict_floor < self.sink:
            req.kv.swa_evict_floor = self.sink
        super()._free_out_of_window_slots(req, pre_len)

    # ---- match

    def create_match_validator(self, match_device_only: bool = False) -> Callable[[Any], bool]:
        window_ok = super().create_match_validator(match_device_only)
        ct = self.component_type
        state = {"sink_ok": True}

        def validator(node: Any) -> bool:
            ok = window_ok(node)  # keeps SGLang's running window state
            if node.component_data[ct].value is None and self._holds_sink(node):
                state["sink_ok"] = False
            if ok and not state["sink_ok"]:
                self.stats.matches_refused += 1
            return ok and state["sink_ok"]

        return validator

    # ---- insert

    def _populate_range(self, *, node: Any, start: int, end: int, params: Any, result: Any,
                        cap_leaf: bool, cache_actions: list[Any]) -> None:
        if start < self.sink_stop:
            # Every node ends at the sink or starts past it, so that a lock pins the sink
            # alone (see pin_sink); later splits never remove the boundary. Split before
            # SGLang queues its rebuilds, which name nodes by id.
            for fragment, lo, hi in list(self._segments(node=node, start=start, end=end)):
                if lo < self.sink_stop < hi:
                    _, action = self.tree_core._split_node(
                        fragment.key, fragment, self.sink_stop - lo
                    )
                    if action is not None:
                        cache_actions.append(action)
        super()._populate_range(node=node, start=start, end=end, params=params, result=result,
                                cap_leaf=cap_leaf, cache_actions=cache_actions)
        evicted = params.get_evicted_seqlen(self.component_type)
        if start >= min(self.sink_stop, evicted):
            return
        # SGLang stored [evicted, end) (its fragments now start at or after `evicted`);
        # what it left as tombstones below the sink is alive in the request: store it too.
        for fragment, lo, hi in list(self._segments(node=node, start=start, end=end)):
            if lo < min(self.sink_stop, evicted):
                self._publish_window(node=fragment, cache_actions=cache_actions)
                result.record_adopted_range(self.component_type, lo, hi)
                self.stats.sink_nodes_stored += 1

    def update_component_on_insert_overlap(self, node: Any, prefix_len: int,
                                           total_prefix_len: int, value_slice: torch.Tensor,
                                           params: Any, result: Any,
                                           cache_actions: list[Any]) -> int:
        consumed_from = super().update_component_on_insert_overlap(
            node, prefix_len, total_prefix_len, value_slice, params, result, cache_actions
        )
        # The tree frees this duplicate range next, full side only below the request's
        # eviction cursor; the request's sink there still holds compressed slots.
        lo = max(total_prefix_len, params.prev_prefix_len)
        hi = min(total_prefix_len + consumed_from, self.sink_stop,
                 params.get_evicted_seqlen(self.component_type))
        if hi > lo:
            cache_actions.append(FreeComponentDeviceSlot(
                [value_slice[lo - total_prefix_len : hi - total_prefix_len]],
                component_type=self.component_type,
            ))
            self.stats.duplicate_sink_slots_freed += hi - lo
        return consumed_from

    # ---- evict

    def _evict_device_start(self, request_cnt: int) -> None:
        super()._evict_device_start(request_cnt)
        self.sink_walk_mark = -1  # tracker reading at the walk's last restart

    def _evict_device_next_node(self, tracker: dict[Any, int], device_frees: dict[Any, Any],
                                host_frees: dict[Any, Any], cache_actions: list[Any]) -> Any:
        ct = self.component_type
        lru = self.tree_core.lru_lists[ct]
        leaves = self.tree_core.evictable_device_leaves
        while True:
            x = self._evict_device_cursor
            if x is not None and not lru.in_list(x):
                x = self._evict_device_cursor = lru.get_lru_no_lock()
            if x is None and self.sink_walk_mark < tracker[ct] < self._evict_device_request_cnt:
                # A split put sink parents behind the cursor: walk again while it frees.
                self.sink_walk_mark = tracker[ct]
                x = self._evict_device_cursor = lru.get_lru_no_lock()
            if x is None or tracker[ct] >= self._evict_device_request_cnt:
                break
            if x in leaves or not self._holds_sink(x):
                break  # a whole leaf may go; a node past the sink may lose its SWA
            start = _start(x)
            if start + len(x.key) > self.sink_stop:
                # Keep [start, sink) in a new parent; the rest (x itself) may be tombstoned.
                _, action = self.tree_core._split_node(x.key, x, self.sink_stop - start)
                if action is not None:
                    cache_actions.append(action)
                self.stats.sink_splits += 1
                break
            leaf = self._device_leaf_below(x)
            if leaf is not None:
                # Unlocked, so nothing below is locked: the sink leaves with its subtree,
                # one leaf per step; the cursor stays until x is a leaf itself.
                self.stats.sink_subtree_leaves += 1
                return leaf.id
            self.stats.sink_evictions_refused += 1
            self._evict_device_cursor = lru.get_prev_no_lock(x)
        return super()._evict_device_next_node(tracker, device_frees, host_frees,
                                               cache_actions=cache_actions)

    def _device_leaf_below(self, node: Any) -> Any:
        """An evictable device leaf in ``node``'s subtree, or None (full KV on the device
        is a top segment of the tree, so following children that hold it ends at a leaf)."""
        full = ComponentType.FULL
        cur = node
        while True:
            below = [c for c in cur.children.values() if c.component_data[full].value is not None]
            if not below:
                break
            cur = below[0]
        return cur if cur is not node and cur in self.tree_core.evictable_device_leaves else None

    def release_window_lock(self, node: Any, swa_uuid_for_lock: int | None,
                            device_frees: dict[Any, Any], host_frees: dict[Any, Any],
                            cache_actions: list[Any]) -> None:
        """SGLang's early window release, minus dropping the SWA of a sink-holding leaf."""
        ct = self.component_type
        root = self.tree_core.root_node
        cur = node
        while cur is not root:
            cd = cur.component_data[ct]
            assert cd.lock_ref > 0, f"SWA window release hit lock_ref=0 on node {cur.id}"
            cd.lock_ref -= 1
            if cd.lock_ref == 0:
                self.tree_core._update_evictable_leaf_sets(cur)
                if cd.value is not None:
                    size = self.reclaimable_value_len(cur)
                    self.tree_core.component_protected_size_[ct] -= size
                    self.tree_core.component_evictable_size_[ct] += size
                    if self.tree_core._is_device_leaf(cur) and not self._holds_sink(cur):
                        self.tree_core._evict_component_and_detach_lru(
                            cur, self, target=_device_layer(), device_frees=device_frees,
                            host_frees=host_frees, cache_actions=cache_actions,
                        )
            if swa_uuid_for_lock and cd.metadata.get("uuid") == swa_uuid_for_lock:
                break
            cur = cur.parent


class SinkFullComponent(FullComponent):
    """SGLang's full tree component; each device lock also pins its path's sink nodes."""

    def _sinks(self) -> SinkSWAComponent | None:
        component = self.tree_core.components_by_type.get(ComponentType.SWA)
        return component if isinstance(component, SinkSWAComponent) else None

    def acquire_component_lock(self, node: Any, result: Any, lock_host: bool = False) -> Any:
        result = super().acquire_component_lock(node, result, lock_host)
        if not lock_host and (sinks := self._sinks()) is not None:
            sinks.pin_sink(node, 1)
        return result

    def release_component_lock(self, node: Any, params: Any, lock_host: bool = False) -> None:
        super().release_component_lock(node, params, lock_host)
        if not lock_host and (sinks := self._sinks()) is not None:
            sinks.pin_sink(node, -1)


def _device_layer() -> Any:
    from sglang.srt.mem_cache.unified_cache.components.base import EvictLayer

    return EvictLayer.DEVICE


def component_overrides() -> dict[Any, type]:
    """The tree components this backend replaces (``component_registry_override``)."""
    return {ComponentType.FULL: SinkFullComponent, ComponentType.SWA: SinkSWAComponent}


def factory(ctx: Any) -> Any:
    """``register_radix_cache_backend`` factory: the unified cache with :class:`SinkSWAComponent`.

    The component override makes SGLang pick its Python tree core, the one that calls
    component methods (the Rust core reimplements the stock SWA rules).
    """
    from sglang.srt.mem_cache.registry import create_unified_radix_cache

    if not ctx.is_hybrid_swa:
        raise ValueError("--radix-cache-backend omni_attn needs --omni-attn-pattern")
    params = ctx.params
    params.component_registry_override = {
        **(params.component_registry_override or {}),
        **component_overrides(),
    }
    cache = create_unified_radix_cache(ctx)
    require_python_core(cache)
    return cache


def require_python_core(cache: Any) -> None:
    """RuntimeError unless ``cache`` runs SGLang's Python tree core, the one that calls the
    component methods the sink rules override (the Rust core would bypass every one of them)."""
    from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedTreeCore

    from omniinfer.sglang_plugin.internals import RADIX_TREE_CORE

    core = getattr(cache, RADIX_TREE_CORE.name, None)
    if not isinstance(core, UnifiedTreeCore):
        raise RuntimeError(
            f"omniinfer: --omni-attn-pattern needs SGLang's Python radix tree core, but the "
            f"cache runs {type(core).__name__}: the sink rules would be bypassed. Unset "
            f"SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND (or set it to python)")


def require_sink_tree(scheduler: Any) -> None:
    """At scheduler start with a pattern on: RuntimeError unless ``scheduler.tree_cache`` is
    this backend's, a ``UnifiedRadixCache`` on SGLang's Python tree core whose SWA and full
    components are :class:`SinkSWAComponent` and :class:`SinkFullComponent`. Passes when the
    scheduler's radix cache is off (``disable_radix_cache``: nothing is cached, so no tree rule
    applies). Every attribute read is a declared internal (``internals.SCHEDULER_STATE``)."""
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    if scheduler.disable_radix_cache:
        return
    cache = scheduler.tree_cache
    if not isinstance(cache, UnifiedRadixCache):
        raise RuntimeError(
            f"omniinfer: --omni-attn-pattern needs --radix-cache-backend {BACKEND_NAME} (SGLang's "
            f"unified radix cache with the sink rules), but the scheduler's tree cache is "
            f"{type(cache).__name__}: cached prefixes would lose their sink")
    require_python_core(cache)
    wanted = component_overrides()
    wrong = {ct.name: type(cache.components.get(ct)).__name__ for ct, cls in wanted.items()
             if not isinstance(cache.components.get(ct), cls)}
    if wrong:
        raise RuntimeError(
            f"omniinfer: --omni-attn-pattern needs the sink-aware tree components "
            f"({', '.join(c.__name__ for c in wanted.values())}), but the scheduler's radix "
            f"cache has {wrong}: the sink rules would be bypassed")


def register_backend() -> None:
    """Make ``--radix-cache-backend omni_attn`` known in this process (idempotent)."""
    from sglang.srt.mem_cache.registry import (
        get_radix_cache_factory,
        register_radix_cache_backend,
    )

    if get_radix_cache_factory(BACKEND_NAME) is None:
        register_radix_cache_backend(BACKEND_NAME, factory)


def ledger(cache: Any) -> dict[str, dict[str, int]]:
    """Per pool: free, evictable, protected and capacity; free + evictable + protected must
    equal capacity whenever no request holds slots outside the tree."""
    allocator = cache.token_to_kv_pool_allocator
    return {
        "full": {
            "free": int(allocator.full_available_size()),
            "evictable": int(cache.full_evictable_size()),
            "protected": int(cache.full_protected_size()),
            "capacity": int(allocator.size_full),
        },
        "compressed": {
            "free": int(allocator.swa_available_size()),
            "evictable": int(cache.swa_evictable_size()),
            "protected": int(cache.swa_protected_size()),
            "capacity": int(allocator.size_swa),
        },
    }


def describe(cache: Any) -> dict[str, Any] | None:
    """The radix cache in use, for the status file; None when prefix reuse is off."""
    if cache is None or getattr(cache, "disable", True) or not hasattr(cache, "components"):
        return None
    component = cache.components.get(ComponentType.SWA)
    return {
        "cache": type(cache).__name__,
        "swa_component": type(component).__name__ if component is not None else None,
        "tree_core": type(cache.tree_core).__name__,
        "sink_rules": isinstance(component, SinkSWAComponent),
        "ledger": ledger(cache),
        **stats(),
    }
