"""The real PD servers the tests of this folder share: two prefill servers, one decode server
and one plain (non-PD) server whose greedy outputs are the reference (SmolLM2-135M, KV over
Mooncake TCP), all four with the shipped OmniAttn pattern (``FLAGS``). Tests that kill a
server start their own, with the same flags."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pd_helpers import PATTERN_FLAGS as FLAGS

from omni_testing import SESSION_PROCESSES
from omniinfer.testbed.pd_servers import pd_server, plain_server, started

MAX_TOTAL_TOKENS = 12288
# Chunked prefill on one prefill server: a 1,000-token prompt goes through it in 3 chunks.
CHUNKED = [*FLAGS, "--chunked-prefill-size", "384"]
DECODE_RELEASE_TIMEOUT_ENV = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT"


# Package scope: started once for the fault, OmniAttn and output tests of this folder (each
# module started its own before, about 150 s a time here), stopped when the folder is done, so
# they (about 10 GB) are not up while other tests start their own deployments.
@pytest.fixture(scope="package")
def pd_servers(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    logs = tmp_path_factory.mktemp("pd-logs")
    servers = {
        "prefill_a": pd_server(smollm2, "prefill", logs, MAX_TOTAL_TOKENS, CHUNKED, "prefill-a"),
        "prefill_b": pd_server(smollm2, "prefill", logs, MAX_TOTAL_TOKENS, FLAGS, "prefill-b"),
        "decode": pd_server(smollm2, "decode", logs, MAX_TOTAL_TOKENS, FLAGS),
        "plain": plain_server(smollm2, logs, MAX_TOTAL_TOKENS, FLAGS),
    }
    # An aborted transfer's KV stays reserved on the decode server until the prefill's drain
    # ack or this timeout (SGLang's default 30 s): the prefill-killed test waits for it.
    from sglang.srt.environ import envs

    assert hasattr(envs, DECODE_RELEASE_TIMEOUT_ENV), \
        f"SGLang no longer reads {DECODE_RELEASE_TIMEOUT_ENV}"
    servers["decode"].env[DECODE_RELEASE_TIMEOUT_ENV] = "5"
    with started(list(servers.values())):
        owned = {server.process.pid for server in servers.values() if server.process}
        SESSION_PROCESSES.update(owned)  # outlive the first module by design
        yield servers
        SESSION_PROCESSES.difference_update(owned)
