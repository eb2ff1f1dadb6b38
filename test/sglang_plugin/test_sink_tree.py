"""OmniAttn's tree is checked at scheduler start: fake schedulers, no server.

With a pattern on, a scheduler whose radix cache is on must hold the ``omni_attn`` backend's
tree: SGLang's ``UnifiedRadixCache`` on the Python tree core with the sink components. The Rust
tree core (SGLang's default core), stock components or another cache would bypass every sink
rule, so :func:`omniinfer.sglang_plugin.omni_attn.radix.require_sink_tree` stops the scheduler.
"""

from __future__ import annotations

from typing import Any

import pytest

from omniinfer.sglang_plugin import internals


def _bare(cls: type) -> Any:
    return cls.__new__(cls)


def _tree(core: type | None = None, swa: type | None = None, full: type | None = None) -> Any:
    """A UnifiedRadixCache object without its constructor: only what the check reads."""
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
    from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedTreeCore
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    from omniinfer.sglang_plugin.omni_attn import radix

    cache = _bare(UnifiedRadixCache)
    cache.tree_core = _bare(core or UnifiedTreeCore)
    cache.components = {ComponentType.SWA: _bare(swa or radix.SinkSWAComponent),
                        ComponentType.FULL: _bare(full or radix.SinkFullComponent)}
    return cache


def _scheduler(cache: Any, radix_off: bool = False) -> Any:
    return type("FakeScheduler", (), {"tree_cache": cache, "disable_radix_cache": radix_off})()


def test_the_sink_tree_passes_and_a_disabled_cache_passes() -> None:
    from omniinfer.sglang_plugin.omni_attn.radix import require_sink_tree

    require_sink_tree(_scheduler(_tree()))
    require_sink_tree(_scheduler(object(), radix_off=True))


def test_the_rust_core_stops_the_scheduler() -> None:
    from omniinfer.sglang_plugin.omni_attn.radix import require_sink_tree

    class RustUnifiedTreeCore:  # stands in for SGLang's Rust adapter (no Python core)
        pass

    with pytest.raises(RuntimeError, match="Python radix tree core.*RustUnifiedTreeCore.*"
                                           "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"):
        require_sink_tree(_scheduler(_tree(core=RustUnifiedTreeCore)))


def test_stock_components_or_another_cache_stop_the_scheduler() -> None:
    from sglang.srt.mem_cache.unified_cache.components.full import FullComponent
    from sglang.srt.mem_cache.unified_cache.components.swa import SWAComponent

    from omniinfer.sglang_plugin.omni_attn.radix import require_sink_tree

    with pytest.raises(RuntimeError, match="sink-aware tree components.*SWAComponent"):
        require_sink_tree(_scheduler(_tree(swa=SWAComponent)))
    with pytest.raises(RuntimeError, match="FULL.*FullComponent"):
        require_sink_tree(_scheduler(_tree(full=FullComponent)))

    class ChunkCache:
        pass

    with pytest.raises(RuntimeError, match="radix-cache-backend omni_attn.*ChunkCache"):
        require_sink_tree(_scheduler(ChunkCache()))


def test_scheduler_start_runs_the_tree_check_with_a_pattern(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from omniinfer.flags import OmniConfig
    from omniinfer.sglang_plugin import hooks, worker

    monkeypatch.setattr(internals, "DECLARED", ())
    monkeypatch.setattr(hooks, "_REGISTERED", {})
    with pytest.raises(RuntimeError, match="radix-cache-backend omni_attn"):
        worker.check_sglang(OmniConfig(omni_attn_pattern="p.json"), _scheduler(object()))
    worker.check_sglang(OmniConfig(), _scheduler(object()))  # no pattern: no tree check
