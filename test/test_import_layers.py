"""Layers by dependency: the pure packages import neither torch, Triton, SGLang nor the SGLang
glue (``omniinfer.sglang_plugin``), at module level or inside a function, except the modules
listed here with the reason they must."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "omniinfer"
PURE = ("proxy", "bench", "emulator", "placement", "attn", "deploy")
HEAVY = ("torch", "triton", "sglang")
GLUE = "omniinfer.sglang_plugin"
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
