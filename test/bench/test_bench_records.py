"""Results files record no machine paths."""

from __future__ import annotations

import argparse
from pathlib import Path

from omniinfer.bench.records import recorded_args


def test_paths_inside_the_repository_are_recorded_relative_to_it(tmp_path: Path) -> None:
    args = argparse.Namespace(out=tmp_path / "results" / "x.json", seeds="1,2",
                              elsewhere=Path("/etc/hosts"), sibling=Path(str(tmp_path) + "x"))
    assert recorded_args(args, tmp_path) == {"out": "results/x.json", "seeds": "1,2",
                                             "elsewhere": "/etc/hosts",
                                             "sibling": str(tmp_path) + "x"}
