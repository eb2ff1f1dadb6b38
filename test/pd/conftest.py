"""Real PD on this CPU: SGLang prefill and decode servers (SmolLM2-135M, KV over Mooncake TCP).

Started once per test module and shared: two prefill servers, one decode server, and one plain
(non-PD) server whose greedy outputs are the reference. Tests that kill a server start their own.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from omni_testing import ROOT
from omniinfer.launch_pd import pd_server, plain_server, started

MODEL = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"
MAX_TOTAL_TOKENS = 8192
# Chunked prefill on one prefill server: a 1,000-token prompt goes through it in 3 chunks.
CHUNKED = ["--chunked-prefill-size", "384"]


@pytest.fixture(scope="session")
def smollm2() -> Path:
    if not (MODEL / "config.json").is_file():
        pytest.fail(f"{MODEL} is missing: scripts/setup.sh converts it (scripts/test.sh runs it)")
    return MODEL


# Module scope, not session: these four servers (about 8 GB) must not stay up while the
# whole-system test and the demo start their four-rank deployments.
@pytest.fixture(scope="module")
def pd_servers(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    logs = tmp_path_factory.mktemp("pd-logs")
    servers = {
        "prefill_a": pd_server(smollm2, "prefill", logs, MAX_TOTAL_TOKENS, CHUNKED, "prefill-a"),
        "prefill_b": pd_server(smollm2, "prefill", logs, MAX_TOTAL_TOKENS, name="prefill-b"),
        "decode": pd_server(smollm2, "decode", logs, MAX_TOTAL_TOKENS),
        "plain": plain_server(smollm2, logs, MAX_TOTAL_TOKENS),
    }
    with started(list(servers.values())):
        yield servers


@pytest.fixture(scope="session")
def victim_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pd-victims")
