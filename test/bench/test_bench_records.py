"""Results files record no machine paths."""

from __future__ import annotations

import argparse
from pathlib import Path

from omniinfer.bench.records import recorded_args, write_results


def test_paths_inside_the_repository_are_recorded_relative_to_it(tmp_path: Path) -> None:
    args = argparse.Namespace(out=tmp_path / "results" / "x.json", seeds="1,2",
                              elsewhere=Path("/etc/hosts"), sibling=Path(str(tmp_path) + "x"))
    assert recorded_args(args, tmp_path) == {"out": "results/x.json", "seeds": "1,2",
                                             "elsewhere": "/etc/hosts",
                                             "sibling": str(tmp_path) + "x"}


def test_a_results_file_is_indented_json_with_a_final_newline(tmp_path: Path) -> None:
    path = tmp_path / "new" / "results.json"
    write_results(path, {"rows": [1]})
    assert path.read_text() == '{\n "rows": [\n  1\n ]\n}\n'
    write_results(path, [], indent=2)
    assert path.read_text() == "[]\n"
