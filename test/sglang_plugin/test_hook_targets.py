"""Every HookRegistry target the plugin can register, exactly, and each resolves in SGLang.

HookRegistry only logs a target that does not resolve; this test runs every registration path of
the plugin (flags, scheduler, CPU fixes with PD, OmniPlacement, OmniAttn) with a recorder in place
of HookRegistry, compares the registrations with :data:`EXPECTED` (a dropped or an extra one
fails, naming the difference) and resolves each target, so an SGLang upgrade that renames one
fails here.
"""

from __future__ import annotations

import pkgutil
from pathlib import Path
from typing import Any

import pytest

from omniinfer.flags import OmniConfig

# Every registration of every path above: target -> hook kinds. Declared once; compared equal.
EXPECTED: dict[str, set[str]] = {
    "sglang.srt.server_args.ServerArgs.add_cli_args": {"after"},
    "sglang.srt.server_args.ServerArgs.from_cli_args": {"before"},
    "sglang.srt.managers.scheduler.Scheduler.__init__": {"after"},
    "sglang.srt.distributed.parallel_state.GroupCoordinator.__init__": {"before"},
    "sglang.srt.layers.moe.fused_moe_native.moe_forward_native": {"around"},
    "sglang.srt.disaggregation.mooncake.conn.MooncakeKVSender.__init__": {"after"},
    "sglang.srt.managers.scheduler.Scheduler.on_idle": {"after", "around"},
    "sglang.srt.eplb.eplb_manager.EPLBManager.__init__": {"after"},
    "sglang.srt.eplb.eplb_manager.EPLBManager.on_forward_pass_end": {"around"},
    "sglang.srt.eplb.expert_distribution._StatAccumulator.append": {"after"},
    "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend":
        {"around"},
    "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_decode":
        {"around"},
    "sglang.srt.mem_cache.base_prefix_cache.BasePrefixCache.evict_sliding_windows": {"around"},
    "sglang.srt.mem_cache.unified_cache.components.swa.SWAComponent._free_out_of_window_slots":
        {"around"},
    "sglang.srt.mem_cache.prefill_budget.estimate_swa_kv_tokens": {"around"},
    "sglang.srt.model_executor.pool_configurator.compute_swa_request_cap": {"around"},
    "sglang.srt.model_executor.pool_configurator.HybridSWAPoolConfigurator"
    ".calculate_pool_sizes_from_max_tokens": {"around"},
    "sglang.srt.model_executor.pool_configurator.SWARequestCapPoolConfigurator"
    ".calculate_pool_sizes_from_max_tokens": {"around"},
    "sglang.srt.managers.scheduler.Scheduler.process_batch_result": {"after"},
    "sglang.srt.managers.schedule_batch.ScheduleBatch.maybe_evict_swa": {"after"},
    "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin._send_kv_chunk":
        {"around"},
    "sglang.srt.disaggregation.decode.DecodePreallocQueue._send_kv_metadata": {"around"},
}


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
    for target in recorded:
        try:
            pkgutil.resolve_name(target)
        except (ImportError, AttributeError, ValueError) as exc:
            unresolved.append(f"{target}: {exc}")
    assert not unresolved, "\n".join(unresolved)
