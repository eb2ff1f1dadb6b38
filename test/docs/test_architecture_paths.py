"""docs/architecture.md stays true to the tree: every path, module and name it gives exists.

The doc's convention for a path in backticks, which this test reads it by:

- ``omniinfer/...`` lies under ``python/``; a path that starts with a top-level folder of the
  repository (``scripts/demo.sh``, ``deploy/...``, ``test/data/...``) is from the repository root;
- any other path is relative to its scope: the package a heading names in backticks
  (``### OmniProxy modules (`omniinfer/proxy/`)``) or, in a table, the folder of the row's first
  path; outside a scope (and as a fallback inside one) it is relative to ``python/omniinfer/``.

Dotted names: ``omniinfer.x.y`` must be a module (an attribute after it must be defined there);
``module.name`` (``core.Router.poll_loads``, ``oas.policy.OASPolicy``) must name something a
module of that name defines, a class's member where the name is a class; ``Class.member`` and a
lone ``ClassName`` must be OmniInfer's (or SGLang's, listed in ``EXTERNAL``).
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "python" / "omniinfer"
TOP = ("python", "scripts", "deploy", "test", "benchmark", "docs", "sgl-kernel-npu")
PATH = re.compile(r"^[\w.*-]+(/[\w.*-]+)*(\.(py|sh|yaml|json|md)|/)$")
RUNTIME_FILES = {"attn.json", "placement.json"}  # status files a server writes, not the tree's
# heads of dotted names that are no module of ours: fields of answers and SGLang's objects
NOT_MODULES = {"usage", "meta_info", "kv_events", "scheduler", "torch", "kubernetes", "sglang"}
EXTERNAL = {  # SGLang's (and Python's) classes the doc names
    "DecodePreallocQueue", "EPLBManager", "HookRegistry", "Scheduler", "ServerArgs",
    "SchedulerDisaggregationPrefillMixin", "TokenizerManager", "UnifiedRadixCache",
    "_StatAccumulator", "HiCache", "LMCache", "Mooncake", "OmniProxy", "OmniAttn",
    "OmniPlacement", "OmniInfer", "SGLang", "NumPy", "PyTorch", "AttributeError",
}


def _text() -> str:
    return DOC.read_text()


def _scoped_paths(text: str) -> list[tuple[str, str | None]]:
    """Every path in backticks with the folder it is relative to (None: no scope)."""
    out: list[tuple[str, str | None]] = []
    heading_scope: str | None = None
    in_code = False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            continue
        if line.startswith("#"):
            found = re.search(r"`(omniinfer/[\w/]+/)`", line)
            heading_scope = found.group(1) if found else None
            continue
        scope = heading_scope
        tokens = [t for t in re.findall(r"`([^`\s]+)`", line) if PATH.match(t)]
        if line.startswith("|") and tokens:
            first = line.split("|")[1]
            head = re.findall(r"`([^`\s]+)`", first)
            if head and PATH.match(head[0]):
                scope = head[0] if head[0].endswith("/") else head[0].rsplit("/", 1)[0] + "/"
        out.extend((t, scope) for t in tokens)
    return out


def _candidates(path: str, scope: str | None) -> list[Path]:
    if path.startswith("omniinfer/"):
        return [ROOT / "python" / path]
    if path.split("/")[0] in TOP:
        return [ROOT / path]
    if scope is None:
        return [PACKAGE / path]
    base = ROOT if scope.split("/")[0] in TOP else ROOT / "python"
    return [base / scope / path, PACKAGE / path]


def _exists(path: Path) -> bool:
    if "*" in path.name:
        return any(path.parent.glob(path.name))
    return path.exists()


@functools.cache
def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _targets(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Tuple):
        return [n for elt in node.elts for n in _targets(elt)]
    return []


def _defined(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """Names a module or class body defines (through if/try blocks too; an import defines none:
    the doc names the module that holds a thing)."""
    out: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, ast.Assign):
            out.update((n, node) for t in node.targets for n in _targets(t))
        elif isinstance(node, ast.AnnAssign):
            out.update((n, node) for n in _targets(node.target))
        elif isinstance(node, (ast.If, ast.Try)):
            out.update(_defined(node.body + node.orelse + getattr(node, "finalbody", [])))
    return out


@functools.cache
def _classes() -> dict[str, list[ast.ClassDef]]:
    out: dict[str, list[ast.ClassDef]] = {}
    for path in _modules().values():
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.ClassDef):
                out.setdefault(node.name, []).append(node)
    return out


def _members(cls: ast.ClassDef, depth: int = 0) -> set[str]:
    """A class's names: its body, ``self.x`` set in its methods, its OmniInfer bases'."""
    names = set(_defined(cls.body))
    for node in ast.walk(cls):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in getattr(node, "targets", [getattr(node, "target", None)]):
                if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                        and target.value.id == "self"):
                    names.add(target.attr)
    for base in cls.bases if depth < 5 else []:
        name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", "")
        for parent in _classes().get(name, []):
            names |= _members(parent, depth + 1)
    return names


def _resolves_in(node: ast.AST, rest: list[str]) -> bool:
    """``rest`` is defined in ``node`` (a module or a class), one class level deep."""
    body = node.body if isinstance(node, (ast.Module, ast.ClassDef)) else []
    defined = _defined(body)
    if not rest:
        return True
    if isinstance(node, ast.ClassDef):
        return rest[0] in _members(node)
    if rest[0] not in defined:
        return False
    inner = defined[rest[0]]
    return not isinstance(inner, ast.ClassDef) or len(rest) == 1 or rest[1] in _members(inner)


def _module_ref_ok(parts: list[str]) -> bool | None:
    """None: no module is called that; else whether some module of that name defines the rest."""
    modules = _modules()
    for cut in range(len(parts), 0, -1):
        suffix = ".".join(parts[:cut])
        found = [p for name, p in modules.items()
                 if name == suffix or name.endswith("." + suffix)]
        if found:
            return any(_resolves_in(_tree(p), parts[cut:]) for p in found)
    return None


def _dotted_problems(token: str) -> list[str]:
    parts = token.split("(", 1)[0].split(".")
    head = parts[0]
    if head in NOT_MODULES:
        return []
    if head[0].isupper() or head.startswith("_") and head[1:2].isupper():
        if head in EXTERNAL:
            return []
        classes = _classes().get(head)
        if not classes:
            return [f"{token}: no class {head}"]
        if not any(parts[1] in _members(c) for c in classes):
            return [f"{token}: {head} has no {parts[1]}"]
        return []
    found = _module_ref_ok(parts)
    if found is None:
        return [f"{token}: no module {head}"]
    return [] if found else [f"{token}: not defined there"]


def test_every_path_the_architecture_doc_names_exists() -> None:
    paths = _scoped_paths(_text())
    missing = [f"{path} (scope {scope})" for path, scope in paths if path not in RUNTIME_FILES
               and not path.startswith(".")
               and not any(_exists(c) for c in _candidates(path, scope))]
    assert len(paths) > 100  # the doc names the modules (the check is not vacuous)
    assert missing == [], f"docs/architecture.md names paths that do not exist: {missing}"


def test_every_module_and_name_the_architecture_doc_gives_exists() -> None:
    text = _text()
    problems = []
    for dotted in sorted(set(re.findall(r"\bomniinfer(?:\.\w+)+", text))):
        if _module_ref_ok(dotted.split(".")) is not True:
            problems.append(f"{dotted}: no such module or name")
    tokens = set(re.findall(r"`([A-Za-z_][\w.]*(?:\([^`]*\))?)`", text))
    dotted_tokens = {t for t in tokens if "." in t.split("(")[0] and not PATH.match(t)
                     and not t.startswith("omniinfer.")}
    for token in sorted(dotted_tokens):
        problems += _dotted_problems(token)
    for token in sorted(t for t in tokens if re.fullmatch(r"_?[A-Z][a-z]\w*", t)):
        if token not in EXTERNAL and token not in _classes():
            problems.append(f"{token}: no class of that name")
    assert len(dotted_tokens) > 50
    assert problems == [], f"docs/architecture.md names what the code does not hold: {problems}"


def test_the_resolver_catches_a_stale_name() -> None:
    assert _dotted_problems("auth.Guard") == ["auth.Guard: not defined there"]
    assert _dotted_problems("core.Router.no_such_method") != []
    assert _dotted_problems("core.Router.poll_loads") == []
    assert _dotted_problems("Router.no_such_member") != []
    assert not any(_exists(c) for c in _candidates("upstream.py", "omniinfer/proxy/"))
    assert any(_exists(c) for c in _candidates("oas/cost.py", "omniinfer/proxy/"))
