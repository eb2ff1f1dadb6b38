"""How one declared SGLang name is checked against the installed SGLang, and used.

The table of names is :mod:`omniinfer.sglang_plugin.internals`; this module is the machinery it
runs: :func:`problem` says why one :class:`Internal` does not hold (None when it does),
:func:`raise_missing` raises naming every one that does not, and :func:`bind` /
:func:`replace_argument` find a hooked call's arguments through a declared signature.

What :func:`problem` proves, per :class:`Kind`:

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
  0.5.23; a dataclass before): the launcher reads or writes it on the parsed namespace, and
  ``ServerArgs.from_cli_args`` silently drops a name that is no field (a read of a renamed one
  through ``getattr(namespace, name, default)`` would silently see the default).
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
from collections.abc import Iterable, Mapping
from functools import cache
from pathlib import Path
from typing import Any


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
    ``name`` (attribute, method, field, top-level function or environment variable), why the
    plugin needs it, the feature that uses it, how it is checked, and the parameters the glue
    uses by name or position."""

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


def raise_missing(found: Iterable[tuple[Internal, str]]) -> None:
    """Raise :class:`SGLangInternalsError` naming each (declaration, problem) of ``found``
    (path, kind, problem, why); return None when ``found`` is empty."""
    lines = [f"  {d.path} [{d.kind.value}]: {p}  ({d.why})" for d, p in found]
    if lines:
        raise SGLangInternalsError(
            "omniinfer: these private SGLang names the plugin relies on are missing or changed "
            "in this SGLang version, so the behaviour that needs them would break:\n"
            + "\n".join(lines)
        )


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

