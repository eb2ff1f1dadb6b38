"""Fixtures of the emulator tests: one emulated worker per module, the real-server capture."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from emu_helpers import CAPTURE, start_emulator

from omniinfer.emulator.process import EmulatorProcess


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmulatorProcess]:
    emu = start_emulator(tmp_path_factory.mktemp("emu"))
    yield emu
    emu.stop()


@pytest.fixture(scope="session")
def capture() -> dict[str, Any]:
    return json.loads(CAPTURE.read_text())
