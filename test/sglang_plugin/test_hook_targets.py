"""Every HookRegistry target the plugin can register is listed in ``targets.py``, and resolves.

HookRegistry only logs a target that does not resolve; this test runs every registration path of
the plugin (flags, scheduler, CPU fixes with PD and DP, OmniPlacement, OmniAttn) with a recorder
in place of HookRegistry, compares the registrations with :data:`targets.ALL` (a dropped or an
extra one fails, naming the difference, and so does a hook kind the list does not name) and
resolves each listed target, so an SGLang upgrade that renames one fails here.
"""

from __future__ import annotations

import pkgutil
from pathlib import Path
from typing import Any

import pytest

from omniinfer.flags import OmniConfig
from omniinfer.sglang_plugin import targets

# Every target of every path above, with its hook kinds: the one list in targets.py.
EXPECTED: dict[str, set[str]] = {t.path: set(t.kinds) for t in targets.ALL}


@pytest.fixture()
def recorded(monkeypatch: pytest.MonkeyPatch) -> dict[str, set[str]]:
    from omniinfer.cpu.server_defaults import DP_WAIT_MS_ENV, PD_MOONCAKE_ENV, PD_POLL_MS_ENV
    from omniinfer.sglang_plugin import hooks

    seen: dict[str, set[str]] = {}

    class Recorder:
        @staticmethod
        def register(target: str, hook: Any, kind: Any) -> None:
            assert callable(hook)
            seen.setdefault(target, set()).add(kind.value)

    monkeypatch.setattr(hooks, "HookRegistry", Recorder)
    monkeypatch.setattr(hooks, "_REGISTERED", {})
    monkeypatch.setenv(PD_MOONCAKE_ENV, "1")
    monkeypatch.setenv(PD_POLL_MS_ENV, "2")
    monkeypatch.setenv(DP_WAIT_MS_ENV, "50")
    return seen


def test_every_plugin_hook_target_resolves(recorded: dict[str, set[str]],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import omniinfer.attn
    from omniinfer.sglang_plugin import cpu_fixes, server_args, worker
    from omniinfer.sglang_plugin.omni_attn import plugin as omni_attn_plugin
    from omniinfer.sglang_plugin.placement import plugin as placement_plugin

    pattern = str(Path(omniinfer.attn.__file__).parent / "patterns" / "smollm2-135m.json")
    server_args.register()
    worker.register()
    monkeypatch.setattr(cpu_fixes, "patch_torch", lambda: [])  # no torch fill-ins here
    cpu_fixes.register()
    placement_plugin.register(OmniConfig(enable_omni_placement=True))
    omni_attn_plugin.register(OmniConfig(omni_attn_pattern=pattern))
    dropped = sorted(set(EXPECTED) - set(recorded))
    extra = sorted(set(recorded) - set(EXPECTED))
    kinds = sorted(f"{t}: {sorted(recorded[t])} != {sorted(EXPECTED[t])}"
                   for t in set(EXPECTED) & set(recorded) if recorded[t] != EXPECTED[t])
    assert recorded == EXPECTED, (
        f"registrations dropped: {dropped}\nunexpected registrations: {extra}\n"
        f"hook kinds differ: {kinds}")
    unresolved = []
    for target in EXPECTED:
        try:
            pkgutil.resolve_name(target)
        except (ImportError, AttributeError, ValueError) as exc:
            unresolved.append(f"{target}: {exc}")
    assert not unresolved, "\n".join(unresolved)


def test_targets_are_listed_once_and_a_kind_not_listed_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.plugins.hook_registry import HookType

    from omniinfer.sglang_plugin import hooks

    monkeypatch.setattr(hooks, "_REGISTERED", {})
    assert len({t.path for t in targets.ALL}) == len(targets.ALL)
    assert all(t.kinds <= {targets.BEFORE, targets.AFTER, targets.AROUND} and t.why
               for t in targets.ALL)
    with pytest.raises(ValueError, match="a before hook is not listed"):
        hooks.register(targets.SCHEDULER_INIT, lambda *a, **k: None, HookType.BEFORE)
    assert hooks.registered() == {}
