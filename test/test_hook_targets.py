"""Every HookRegistry target the plugin can register resolves in the installed SGLang.

HookRegistry only logs a target that does not resolve; this test runs every registration path of
the plugin (flags, scheduler, CPU fixes with PD, OmniPlacement, OmniAttn) with a recorder in place
of HookRegistry and resolves each target, so an SGLang upgrade that renames one fails here.
"""

from __future__ import annotations

import pkgutil
from pathlib import Path
from typing import Any

import pytest

from omniinfer.flags import OmniConfig


@pytest.fixture()
def recorded(monkeypatch: pytest.MonkeyPatch) -> dict[str, set[str]]:
    from omniinfer.cpu.server_defaults import PD_MOONCAKE_ENV, PD_POLL_MS_ENV
    from omniinfer.sglang_plugin import hooks

    targets: dict[str, set[str]] = {}

    class Recorder:
        @staticmethod
        def register(target: str, hook: Any, kind: Any) -> None:
            assert callable(hook)
            targets.setdefault(target, set()).add(kind.value)

    monkeypatch.setattr(hooks, "HookRegistry", Recorder)
    monkeypatch.setattr(hooks, "_REGISTERED", {})
    monkeypatch.setenv(PD_MOONCAKE_ENV, "1")
    monkeypatch.setenv(PD_POLL_MS_ENV, "2")
    return targets


def test_every_plugin_hook_target_resolves(recorded: dict[str, set[str]],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import omniinfer.attn
    from omniinfer.sglang_plugin import cpu_fixes, omni_attn, placement_hooks, server_args, worker

    pattern = str(Path(omniinfer.attn.__file__).parent / "patterns" / "smollm2-135m.json")
    server_args.register()
    worker.register()
    monkeypatch.setattr(cpu_fixes, "patch_torch", lambda: [])  # no torch fill-ins here
    cpu_fixes.register()
    placement_hooks.register(OmniConfig(enable_omni_placement=True))
    omni_attn.register(OmniConfig(omni_attn_pattern=pattern))
    expected = {
        "sglang.srt.server_args.ServerArgs.add_cli_args",
        "sglang.srt.server_args.ServerArgs.from_cli_args",
        "sglang.srt.managers.scheduler.Scheduler.__init__",
        "sglang.srt.distributed.parallel_state.GroupCoordinator.__init__",
        "sglang.srt.layers.moe.fused_moe_native.moe_forward_native",
        "sglang.srt.disaggregation.mooncake.conn.MooncakeKVSender.__init__",
        "sglang.srt.managers.scheduler.Scheduler.on_idle",
        omni_attn.EVICT_SLIDING_WINDOWS, omni_attn.SWA_COMPONENT_FREE,
        omni_attn.ESTIMATE_SWA_TOKENS, omni_attn.SWA_REQUEST_CAP, omni_attn.MAYBE_EVICT_SWA,
        omni_attn.PROCESS_BATCH_RESULT, *[f"{c}.calculate_pool_sizes_from_max_tokens"
                                          for c in omni_attn.POOL_CONFIGURATORS],
        f"{omni_attn.TORCH_NATIVE}.forward_extend", f"{omni_attn.TORCH_NATIVE}.forward_decode",
        "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin._send_kv_chunk",
        "sglang.srt.disaggregation.decode.DecodePreallocQueue._send_kv_metadata",
    }
    missing = expected - set(recorded)
    assert not missing, f"registrations dropped: {sorted(missing)}"
    assert any("MooncakeKVSender" in t for t in recorded)  # the PD paths were registered
    assert "around" in recorded.get("sglang.srt.managers.scheduler.Scheduler.on_idle", set())
    unresolved = []
    for target in recorded:
        try:
            pkgutil.resolve_name(target)
        except (ImportError, AttributeError, ValueError) as exc:
            unresolved.append(f"{target}: {exc}")
    assert not unresolved, "\n".join(unresolved)
