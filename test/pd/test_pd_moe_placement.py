"""OmniPlacement under real PD: SmolLM2-MoE prefill and decode servers with expert parallelism
(2 ranks each) and the placement controller on, behind OmniProxy (oas). Migrations are decided,
staged and switched in on the decode server while PD traffic runs, and greedy outputs stay the
dense SmolLM2's, token for token."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pd_helpers import PROMPTS, assert_idle, gen_body, omniproxy, post

from omni_testing import ROOT
from omniinfer.launch import cpu_env
from omniinfer.launch_pd import pd_server, plain_server, started

pytestmark = pytest.mark.server

MOE = ROOT / ".cache" / "models" / "SmolLM2-135M-MoE"
EP = ["--tp", "2", "--ep", "2", "--attn-dp-size", "2", "--ep-num-redundant-experts", "2",
      "--enable-omni-placement", "--omni-placement-interval", "4",
      "--omni-placement-trigger", "1.02", "--omni-placement-margin", "0.01"]
CASES = PROMPTS[:4]
ROUNDS = 3


@pytest.fixture(scope="module")
def moe_pd(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    if not (MOE / "config.json").is_file():
        pytest.fail(f"{MOE} is missing: scripts/setup.sh builds it")
    logs = tmp_path_factory.mktemp("pd-moe")
    prefill = pd_server(MOE, "prefill", logs, 4096, EP, "moe-prefill")
    decode = pd_server(MOE, "decode", logs, 4096, EP, "moe-decode")
    for server in (prefill, decode):
        server.env = cpu_env(server.env, threads_bind="0|1")
    dense = plain_server(smollm2, logs, 4096)
    with started([prefill, decode, dense]):
        yield {"prefill": prefill, "decode": decode, "dense": dense, "logs": logs}


def _placement(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/omni/placement", timeout=30) as r:
        return json.loads(r.read())


def test_migrations_adopted_on_the_decode_server_and_outputs_equal_the_dense_model(
        moe_pd: dict[str, Any]) -> None:
    expected = {}
    for prompt in CASES:
        status, answer = post(moe_pd["dense"].base_url + "/generate", gen_body(prompt))
        assert status == 200, answer
        expected[prompt] = answer["text"]
    pair = [moe_pd["prefill"], moe_pd["decode"]]
    with omniproxy(pair, "oas", MOE, moe_pd["logs"]) as router:
        for round_ in range(ROUNDS):  # before, during and after migrations
            for prompt in CASES:
                status, answer = post(router.base_url + "/generate", gen_body(prompt))
                assert status == 200, answer
                assert answer["text"] == expected[prompt], (round_, prompt[:40])
    status = _placement(moe_pd["decode"].base_url)
    adopted = [m for m in status["migrations"] if m["state"] == "adopted"]
    assert adopted, status
    assert all(m["switched_at_pass"] > m["decided_at_pass"] for m in adopted)
    assert _placement(moe_pd["prefill"].base_url)["decisions"]
    assert_idle(moe_pd["decode"].base_url)
