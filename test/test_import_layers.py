"""Layers by dependency: the pure packages import neither torch, Triton, SGLang nor the SGLang
glue (``omniinfer.sglang_plugin``), at module level or inside a function, except the modules
listed here with the reason they must; and no module of the product imports the one-host test
bed (``omniinfer.testbed``: servers, PD pairs and models for tests, benchmarks and the demo),
which sits on top of the product."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "omniinfer"
PURE = ("proxy", "bench", "emulator", "placement", "attn", "deploy")
HEAVY = ("torch", "triton", "sglang")
GLUE = "omniinfer.sglang_plugin"
TESTBED = "omniinfer.testbed"
ALLOWED = {
    "attn/evaluator.py": "scores a pattern by running the model (torch)",
    "attn/masks.py": "builds the pattern's attention masks as torch tensors",
    "attn/decode.py": "decodes with the model under a pattern (torch)",
    "attn/passkey.py": "runs the model on passkey prompts (torch)",
    "placement/staging.py": "stages expert weights in host memory (torch tensors and streams)",
    "placement/loads.py": "accepts a torch tensor of expert counts (imported only when given one)",
    "placement/peer.py": "loads SGLang's own EPLB algorithm file, declared in the glue's "
                         "internals table, as the comparison peer (never the planner)",
}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _offending(names: set[str]) -> list[str]:
    return sorted(n for n in names if n.split(".")[0] in HEAVY or n == GLUE
                  or n.startswith(GLUE + "."))


def test_pure_packages_import_no_torch_sglang_or_glue() -> None:
    found: dict[str, list[str]] = {}
    for package in PURE:
        for path in sorted((PACKAGE / package).rglob("*.py")):
            bad = _offending(_imports(path))
            if bad:
                found[path.relative_to(PACKAGE).as_posix()] = bad
    unexpected = {k: v for k, v in found.items() if k not in ALLOWED}
    assert unexpected == {}, f"new heavy or glue imports in pure packages: {unexpected}"
    stale = sorted(set(ALLOWED) - set(found))
    assert stale == [], f"allowed but no longer needed (remove them from ALLOWED): {stale}"


def test_the_check_sees_imports_inside_functions(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    import torch\n    from omniinfer.sglang_plugin.x import y\n")
    assert _offending(_imports(module)) == ["omniinfer.sglang_plugin.x", "torch"]


def _module_name(path: Path, root: Path) -> list[str]:
    """The dotted parts of the module at ``path`` in the package whose folder is ``root``."""
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    return parts[:-1] if parts[-1] == "__init__" else parts


def _named_modules(path: Path, root: Path) -> set[str]:
    """Every module ``path`` names: ``import a.b``, ``from a import b`` (both ``a`` and ``a.b``),
    relative imports resolved against its package, and string literals that are dotted names
    under ``omniinfer`` (``importlib.import_module(...)``, ``python -m ...`` arguments)."""
    module = _module_name(path, root)
    package = module if path.name == "__init__.py" else module[:-1]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            head = ".".join([*base, *([node.module] if node.module else [])])
            names.add(head)
            names.update(f"{head}.{alias.name}" for alias in node.names)
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and node.value.startswith("omniinfer.") and node.value.isascii()
              and all(part.isidentifier() for part in node.value.split("."))):
            names.add(node.value)
    return names


def _testbed(names: set[str]) -> list[str]:
    return sorted(n for n in names if n == TESTBED or n.startswith(TESTBED + "."))


def test_the_product_never_imports_the_test_bed() -> None:
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if relative.parts[0] == "testbed":
            continue
        bad = _testbed(_named_modules(path, PACKAGE))
        if bad:
            found[relative.as_posix()] = bad
    assert found == {}, f"the product imports the test bed (omniinfer.testbed): {found}"


def test_the_test_bed_check_sees_every_form(tmp_path: Path) -> None:
    root = tmp_path / "omniinfer"
    (root / "deploy").mkdir(parents=True)
    local = root / "deploy" / "local.py"
    forms = {
        "import omniinfer.testbed.servers\n": "omniinfer.testbed.servers",
        "from omniinfer.testbed.pd_servers import PDServer\n": "omniinfer.testbed.pd_servers",
        "from omniinfer import testbed\n": "omniinfer.testbed",
        "from ..testbed import demo\n": "omniinfer.testbed.demo",
        "from .. import testbed\n": "omniinfer.testbed",
        "def f():\n    from omniinfer.testbed.models import tiny\n": "omniinfer.testbed.models",
        "CMD = ['-m', 'omniinfer.testbed.demo']\n": "omniinfer.testbed.demo",
    }
    for source, expected in forms.items():
        local.write_text(source)
        assert expected in _testbed(_named_modules(local, root)), source
    local.write_text('"""Mentions omniinfer.testbed in prose only."""\n'
                     "from omniinfer.child_process import free_port\n"
                     "from ..cpu.server_env import cpu_env\n")
    assert _testbed(_named_modules(local, root)) == []
