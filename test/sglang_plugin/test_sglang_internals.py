"""The private SGLang names the plugin relies on are declared once and hold in the pinned SGLang.

``internals.check`` resolves every declaration (no server); a renamed declaration makes it fail
naming it; the plugin's source touches no private SGLang name that is not declared; arguments
the glue used to find by position are bound to the declared signatures. Fields, keywords and
environment variables, each renamed in turn, are in ``test_sglang_surface.py``.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from omniinfer.sglang_plugin import internals

PLUGIN = Path(internals.__file__).parent
PACKAGE = PLUGIN.parent


def test_every_declared_internal_holds_in_the_pinned_sglang() -> None:
    assert {d.feature for d in internals.DECLARED} <= internals.FEATURES
    assert len({(d.owner, d.name) for d in internals.DECLARED}) == len(internals.DECLARED)
    internals.check()  # every feature, the comparison peer's file included


def _renamed(decl: internals.Internal, **change: Any) -> internals.Internal:
    return dataclasses.replace(decl, **change)


def test_a_renamed_internal_fails_naming_every_missing_one(monkeypatch: pytest.MonkeyPatch) -> None:
    fakes = [
        _renamed(internals.EPLB_GET_MODEL, name="_get_model_gone"),  # instance attribute
        _renamed(internals.HOOK_REGISTRY_PATCHED, name="_patched_gone"),  # class attribute
        _renamed(internals.STAT_ACCUMULATOR_APPEND, params=("single_pass_payload",)),
        _renamed(internals.SEND_KV_CHUNK, params=("end_idx", "req")),  # order changed
        _renamed(internals.DEEPSEEK_REBALANCE, name="rebalance_experts_gone"),  # source file
        _renamed(internals.GROUP_COORDINATOR_INIT, owner="sglang.srt.no_such_module.Thing"),
    ]
    monkeypatch.setattr(internals, "DECLARED", (internals.EPLB_MODEL_CONFIG, *fakes))
    with pytest.raises(internals.SGLangInternalsError) as caught:
        internals.check()
    message = str(caught.value)
    for fake in fakes:
        assert fake.path in message, message
    assert internals.EPLB_MODEL_CONFIG.path not in message
    assert "never assigned on self" in message and "no such attribute" in message
    assert "no parameter single_pass_payload" in message and "in this order" in message
    assert "no top-level function rebalance_experts_gone" in message
    assert "owner does not resolve" in message
    # Start-up checks only the features switched on.
    placement_only = _renamed(internals.EPLB_MODEL_CONFIG, name="_model_config_gone")
    monkeypatch.setattr(internals, "DECLARED", (internals.EPLB_GET_MODEL, placement_only))
    internals.check(internals.start_up_features(placement=False, omni_attn=True, cpu_engine=True))
    with pytest.raises(internals.SGLangInternalsError, match="_model_config_gone"):
        internals.check(internals.start_up_features(placement=True, omni_attn=False,
                                                    cpu_engine=False))


def test_the_launcher_stops_with_one_line_on_a_renamed_field(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from omniinfer.sglang_plugin import server_args

    (eplb,) = [d for d in internals.SERVER_ARGS_FIELDS if d.name == "enable_eplb"]
    gone = _renamed(eplb, name="enable_eplb_RENAMED")
    monkeypatch.setattr(internals, "DECLARED", (gone,))
    namespace = argparse.Namespace(enable_omni_placement=True, ep_size=2)
    with pytest.raises(SystemExit) as stopped:
        server_args._before_from_cli_args(args=namespace)
    assert stopped.value.code == 2
    assert "enable_eplb_RENAMED" in capsys.readouterr().err


def test_scheduler_start_stops_on_a_missing_internal(monkeypatch: pytest.MonkeyPatch) -> None:
    from omniinfer.flags import OmniConfig
    from omniinfer.sglang_plugin import worker

    gone = _renamed(internals.HOOK_REGISTRY_PATCHED, name="_patched_gone")
    monkeypatch.setattr(internals, "DECLARED", (gone,))
    with pytest.raises(internals.SGLangInternalsError, match="HookRegistry._patched_gone"):
        worker.check_sglang(OmniConfig(), scheduler=None)


def test_accumulator_counts_are_found_by_name_or_position() -> None:
    from omniinfer.sglang_plugin.placement import plugin as placement_plugin

    seen: list[Any] = []

    class Controller:
        def on_counts(self, counts: Any) -> None:
            seen.append(counts)

    placement_plugin._State.controller = Controller()
    try:
        data = {"global_physical_count": "counts"}
        placement_plugin._after_accumulator_append(None, "acc", 1, "key", data, {})
        placement_plugin._after_accumulator_append(None, "acc", 1, "key",
                                                  single_pass_data=data, outputs={})
        placement_plugin._after_accumulator_append(None, "acc", 1, "key", {"other": 0}, {})
    finally:
        placement_plugin._State.controller = None
    assert seen == ["counts", "counts"]


# ---------------------------------------------------------------- nothing undeclared


def _sglang_imports(tree: ast.AST) -> set[str]:
    return {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
            and (n.module or "").startswith("sglang") for a in n.names}


def _subclasses_sglang(node: ast.ClassDef, sglang_names: set[str]) -> bool:
    return any(isinstance(b, ast.Name) and b.id in sglang_names for b in node.bases)


def _own_names(tree: ast.AST) -> set[str]:
    """Names our code defines: functions, classes, assigned names, and the methods and ``self``
    fields of our classes that do not subclass an SGLang class."""
    sglang_names = _sglang_imports(tree)
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and _subclasses_sglang(node, sglang_names):
            skip |= {id(n) for n in ast.walk(node) if n is not node}
    own = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
              and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            own.add(node.attr)
    return own


def _private_attributes(tree: ast.AST) -> set[str]:
    return {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
            and n.attr.startswith("_") and not (n.attr.startswith("__") and n.attr.endswith("__"))}


def _sglang_subclass_overrides() -> tuple[set[str], set[str]]:
    """(methods of our SGLang subclasses that SGLang's base defines, those it does not)."""
    from omniinfer.sglang_plugin.omni_attn import radix, triton_backend

    overrides, new = set(), set()
    for cls in (radix.SinkSWAComponent, radix.SinkFullComponent,
                triton_backend.backend_class()):
        base = cls.__mro__[1]
        for name, value in vars(cls).items():
            if name.startswith("__") or not callable(value):
                continue
            (overrides if hasattr(base, name) else new).add(name)
    return overrides, new


def test_the_plugin_touches_no_undeclared_private_sglang_name() -> None:
    """By name (owners are not resolved statically): every ``obj._name`` in the plugin that no
    code of ours defines is declared, and so is every private method our SGLang subclasses
    override. A private name of ours equal to an SGLang one would hide it: keep them apart."""
    own: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        own |= _own_names(ast.parse(path.read_text()))
    touched: set[str] = set()
    for path in [*PLUGIN.rglob("*.py"), PACKAGE / "placement" / "peer.py"]:
        touched |= _private_attributes(ast.parse(path.read_text()))
    assert {"_get_model", "_model_config", "_split_node", "_patched"} <= touched - own  # not vacuous
    overrides, new_methods = _sglang_subclass_overrides()
    declared = {d.name for d in internals.DECLARED}
    undeclared = sorted((touched - own - new_methods - declared)
                        | {m for m in overrides if m.startswith("_")} - declared)
    assert not undeclared, f"private SGLang names used but not declared: {undeclared}"
