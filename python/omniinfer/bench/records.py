"""How benchmark results files are written and record their arguments: no machine paths."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def recorded_args(args: argparse.Namespace, root: Path) -> dict[str, str]:
    """Each argument as text, a path inside ``root`` (the repository) made relative to it."""
    prefix = str(root) + "/"
    return {k: str(v)[len(prefix):] if str(v).startswith(prefix) else str(v)
            for k, v in vars(args).items()}


def write_results(path: Path, data: Any, indent: int = 1) -> None:
    """``data`` as JSON (``indent``) and a final newline into ``path``, its folder made first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent) + "\n")
