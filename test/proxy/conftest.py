"""Fixtures of the router tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture
def tmp_logs(tmp_path: Path) -> Iterator[tuple[Path, list[Any]]]:
    """A folder for the test's logs, and a list the test appends what it starts to (anything
    with ``stop()``): stopped last first when the test ends."""
    started: list[Any] = []
    yield tmp_path, started
    for thing in reversed(started):
        thing.stop()
