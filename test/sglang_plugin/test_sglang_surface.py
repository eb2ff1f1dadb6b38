"""One checked SGLang surface: fields, keywords and environment variables.

- Renaming any declared ``ServerArgs`` field or environment variable in a copy of the table
  fails the launch check naming it; renaming any declared keyword (a parameter the glue passes
  or reads by name or position) fails the scheduler start check naming it. Parametrized over
  every such declaration, so each one is shown to be checked.
- Nothing undeclared: every ``ServerArgs`` field the glue reads or writes on the namespace and
  every ``SGLANG_*`` variable the package names is declared.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import re
from pathlib import Path

import pytest

from omniinfer.sglang_plugin import internals

PLUGIN = Path(internals.__file__).parent
PACKAGE = PLUGIN.parent

NAMED = [d for d in internals.DECLARED if d.kind in internals.LAUNCH_KINDS]
KEYWORDS = [(d, p) for d in internals.DECLARED for p in d.params]


def _short(decl: internals.Internal) -> str:
    return f"{decl.owner.rsplit('.', 1)[-1]}.{decl.name}"


@pytest.mark.parametrize("decl", NAMED, ids=_short)
def test_a_renamed_field_or_variable_fails_the_launch_check_naming_it(
        decl: internals.Internal, monkeypatch: pytest.MonkeyPatch) -> None:
    gone = dataclasses.replace(decl, name=decl.name + "_RENAMED")
    table = tuple(gone if d is decl else d for d in internals.DECLARED)
    monkeypatch.setattr(internals, "DECLARED", table)
    with pytest.raises(internals.SGLangInternalsError) as caught:
        internals.check_launch(internals.FEATURES)
    message = str(caught.value)
    assert gone.path in message
    assert ("no such field" if decl.kind is internals.Kind.FIELD else "no longer read there") \
        in message
    assert message.count("[field]") + message.count("[environment variable]") == 1  # only it


@pytest.mark.parametrize(("decl", "param"), KEYWORDS,
                         ids=[f"{_short(d)}:{p}" for d, p in KEYWORDS])
def test_a_renamed_keyword_fails_the_start_check_naming_it(
        decl: internals.Internal, param: str, monkeypatch: pytest.MonkeyPatch) -> None:
    renamed = tuple(p + "_renamed" if p == param else p for p in decl.params)
    gone = dataclasses.replace(decl, params=renamed)
    monkeypatch.setattr(internals, "DECLARED", (gone,))
    with pytest.raises(internals.SGLangInternalsError) as caught:
        internals.check(internals.FEATURES)
    assert f"{gone.path} [" in str(caught.value)
    assert f"no parameter {param}_renamed" in str(caught.value)


def test_the_launch_and_start_checks_cover_what_the_issue_names() -> None:
    fields = {d.name for d in internals.DECLARED if d.kind is internals.Kind.FIELD}
    assert {"enable_eplb", "radix_cache_backend", "disable_radix_cache", "page_size",
            "sleep_on_idle"} <= fields
    params = {p for _, p in KEYWORDS}
    assert {"moe_ep_rank", "update_layer_ids", "decode_prefix_len"} <= params
    assert {d.name for d in NAMED if d.kind is internals.Kind.ENV} >= {
        "SGLANG_SWA_EVICTION_INTERVAL", "SGLANG_USE_CPU_ENGINE", "HOST_IP"}


# ---------------------------------------------------------------- nothing undeclared

# Files that read or write SGLang's parsed launcher namespace.
NAMESPACE_FILES = [*PLUGIN.rglob("*.py"), PACKAGE / "cpu" / "server_defaults.py"]
NAMESPACE_NAMES = {"namespace"}
ATTR_CALLS = {"getattr", "hasattr", "setattr"}


def _omni_flags() -> set[str]:
    from omniinfer.flags import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return {a.dest for a in parser._actions}


def _namespace_fields(tree: ast.AST) -> tuple[set[str], list[str]]:
    """(field names read or written on the namespace or on ``*.server_args``, dynamic uses)."""
    names: set[str] = set()
    dynamic: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            value = node.value
            if isinstance(value, ast.Name) and value.id in NAMESPACE_NAMES:
                names.add(node.attr)
            elif isinstance(value, ast.Attribute) and value.attr == "server_args":
                names.add(node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ATTR_CALLS and len(node.args) >= 2
              and isinstance(node.args[0], ast.Name) and node.args[0].id in NAMESPACE_NAMES):
            key = node.args[1]
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                names.add(key.value)
            elif not (isinstance(key, ast.Attribute) and key.attr == "name"):  # decl.name: ok
                dynamic.append(ast.unparse(node))
    return names, dynamic


def test_every_server_args_field_the_glue_touches_is_declared() -> None:
    used: set[str] = set()
    dynamic: list[str] = []
    for path in NAMESPACE_FILES:
        names, found = _namespace_fields(ast.parse(path.read_text()))
        used |= names
        dynamic += [f"{path.name}: {d}" for d in found]
    used -= _omni_flags()
    assert {"radix_cache_backend", "sleep_on_idle", "ep_size", "max_total_tokens",
            "enable_eplb", "host"} <= used  # not vacuous
    declared = {d.name for d in internals.DECLARED if d.kind is internals.Kind.FIELD}
    assert not dynamic, f"namespace fields named at run time (use a declared .name): {dynamic}"
    assert not sorted(used - declared), f"undeclared ServerArgs fields: {sorted(used - declared)}"


def test_every_sglang_environment_variable_the_package_names_is_declared() -> None:
    named: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        named |= set(re.findall(r"\bSGLANG_[A-Z0-9_]+\b", text))
        named |= {"HOST_IP"} if re.search(r"(?<![A-Z_])HOST_IP\b", text) else set()
    declared = {d.name for d in internals.DECLARED if d.kind is internals.Kind.ENV}
    assert {"SGLANG_USE_CPU_ENGINE", "SGLANG_HOST_IP"} <= named
    assert not sorted(named - declared), f"undeclared variables: {sorted(named - declared)}"
