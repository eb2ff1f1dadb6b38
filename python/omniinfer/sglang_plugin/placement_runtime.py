"""Former home of :mod:`omniinfer.sglang_plugin.placement.runtime`, kept for one importer.

Only ``planner_config`` is re-exported, for ``omniinfer.emulator.sparse`` (maintained
elsewhere), which still imports it from here. Delete this module once that import names
``omniinfer.sglang_plugin.placement.runtime``; nothing else may use it.
"""

from __future__ import annotations

from omniinfer.sglang_plugin.placement.runtime import planner_config

__all__ = ["planner_config"]
