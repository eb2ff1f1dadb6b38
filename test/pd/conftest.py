"""Real PD on this CPU: SGLang prefill and decode servers (SmolLM2-135M, KV over Mooncake TCP).
The model for every test here; the servers the outputs and fault tests share are in
``shared_servers/conftest.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from omni_testing import ROOT

MODEL = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"


@pytest.fixture(scope="session")
def smollm2() -> Path:
    if not (MODEL / "config.json").is_file():
        pytest.fail(f"{MODEL} is missing: scripts/setup.sh converts it (scripts/test.sh runs it)")
    return MODEL


@pytest.fixture(scope="session")
def victim_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pd-victims")
