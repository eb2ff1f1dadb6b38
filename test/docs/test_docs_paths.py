"""docs/architecture.md stays true to the tree: every module path it names (``x.py``,
``pkg/x.py``, ``omniinfer/pkg/x.py``) is a file of the repository."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SEARCHED = ("python", "benchmark", "scripts", "sgl-kernel-npu", "test", "deploy")


def _files() -> set[str]:
    out: set[str] = set()
    for top in SEARCHED:
        for path in (ROOT / top).rglob("*.py"):
            if ".venv" not in path.parts and "__pycache__" not in path.parts:
                out.add(path.relative_to(ROOT).as_posix())
    return out


def test_every_module_path_in_the_architecture_doc_exists() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    named = sorted(set(re.findall(r"`([A-Za-z0-9_./-]+\.py)`", text)))
    files = _files()
    missing = [name for name in named
               if not any(f == name or f.endswith("/" + name) for f in files)]
    assert len(named) > 50  # the doc names the modules (the check is not vacuous)
    assert missing == [], f"docs/architecture.md names modules that do not exist: {missing}"
