"""Every HookRegistry registration of the plugin goes through here, so that none can fail quietly.

SGLang's ``HookRegistry.apply_hooks`` only logs when a target does not resolve (a renamed
module or method after an upgrade); the behaviour it carried would then be silently gone.
:func:`register` takes a :class:`~omniinfer.sglang_plugin.targets.Target` (every target the
plugin hooks is listed in :mod:`omniinfer.sglang_plugin.targets`), records it, and
:func:`verify` raises, naming the targets that were not applied. The scheduler-init hook calls :func:`verify` (after
:func:`omniinfer.sglang_plugin.internals.check`, which also checks ``HookRegistry._patched``,
the record read here), so a scheduler with a missing hook stops at start-up instead of serving
without it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from omniinfer.sglang_plugin.targets import Target

_REGISTERED: dict[str, str] = {}


class HookTargetError(RuntimeError):
    """A plugin hook target did not resolve in this SGLang version."""


def register(target: Target, hook: Callable[..., Any], kind: HookType) -> None:
    """Register ``hook`` on ``target.path`` and remember why the plugin needs it; ValueError
    when ``kind`` is not one of the kinds the target lists (the list is the contract the hook
    test checks)."""
    if kind.value not in target.kinds:
        raise ValueError(f"{target.path}: a {kind.value} hook is not listed in targets.py "
                         f"(listed: {sorted(target.kinds)})")
    HookRegistry.register(target.path, hook, kind)
    _REGISTERED[target.path] = target.why


def registered() -> dict[str, str]:
    """{target: why} of every registration so far in this process."""
    return dict(_REGISTERED)


def unapplied() -> list[str]:
    """Targets registered by the plugin that HookRegistry has not patched (yet or at all),
    read from ``HookRegistry._patched`` (declared in :mod:`internals`)."""
    patched: set[str] = HookRegistry._patched
    return [t for t in _REGISTERED if t not in patched]


def verify() -> None:
    """Raise :class:`HookTargetError` unless every registered target was applied."""
    missing = unapplied()
    if missing:
        lines = [f"  {t}  ({_REGISTERED[t]})" for t in missing]
        raise HookTargetError(
            "omniinfer: these SGLang hook targets did not resolve in this SGLang version, "
            "so the behaviour they carry would be missing:\n" + "\n".join(lines)
        )
