"""How benchmark results files record their arguments: no machine paths."""

from __future__ import annotations

import argparse
from pathlib import Path


def recorded_args(args: argparse.Namespace, root: Path) -> dict[str, str]:
    """Each argument as text, a path inside ``root`` (the repository) made relative to it."""
    prefix = str(root) + "/"
    return {k: str(v)[len(prefix):] if str(v).startswith(prefix) else str(v)
            for k, v in vars(args).items()}
