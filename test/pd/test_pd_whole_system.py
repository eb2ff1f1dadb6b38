"""OmniPlacement under real PD: Qwen3-MoE prefill and decode servers with expert parallelism
(``--tp 2 --ep 2``, two ranks each) and the placement controller on, behind OmniProxy (oas).
Migrations are decided, staged and switched in on the decode server while PD traffic runs, and
greedy outputs stay Hugging Face transformers' token for token.

The model is the tiny random Qwen3-MoE: SmolLM2-MoE's attention (9 heads, 3 KV heads) does not
split over two TP ranks, and SGLang's data-parallel attention does not run on the CPU engine.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pd_helpers import assert_idle, omniproxy, post

from omni_testing import hf_greedy
from omniinfer.launch import cpu_env
from omniinfer.launch_pd import pd_server, started

pytestmark = pytest.mark.server

EP = ["--tp", "2", "--ep", "2", "--ep-num-redundant-experts", "2",
      "--enable-omni-placement", "--omni-placement-interval", "4",
      "--omni-placement-trigger", "1.02", "--omni-placement-margin", "0.01"]
TEXTS = ["O Romeo, Romeo! wherefore art thou Romeo? " * 2, "Now is the winter of our discontent",
         "To be, or not to be, that is the question"]
NEW_TOKENS = 12
ROUNDS = 4


@pytest.fixture(scope="module")
def moe_pd(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[dict[str, Any]]:
    logs = tmp_path_factory.mktemp("pd-moe")
    model = tiny_models["qwen3_moe"]
    servers = [pd_server(model, mode, logs, 4096, EP, f"moe-{mode}")
               for mode in ("prefill", "decode")]
    for server in servers:
        server.env = cpu_env(server.env, threads_bind="0|1")
    with started(servers):
        yield {"prefill": servers[0], "decode": servers[1], "logs": logs, "model": model}


def _placement(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/omni/placement", timeout=30) as r:
        return json.loads(r.read())


def test_migrations_adopted_on_the_decode_server_during_pd_serving(
        moe_pd: dict[str, Any]) -> None:
    from transformers import AutoTokenizer

    model = moe_pd["model"]
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    expected = [hf_greedy(model, ids, NEW_TOKENS) for ids in prompts]
    pair = [moe_pd["prefill"], moe_pd["decode"]]
    with omniproxy(pair, "oas", model, moe_pd["logs"]) as router:
        for round_ in range(ROUNDS):  # before, during and after migrations
            for ids, want in zip(prompts, expected, strict=True):
                status, answer = post(router.base_url + "/generate", {
                    "input_ids": ids, "sampling_params": {
                        "max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}})
                assert status == 200, answer
                assert answer["output_ids"] == want, f"round {round_}"
    status = _placement(moe_pd["decode"].base_url)
    adopted = [m for m in status["migrations"] if m["state"] == "adopted"]
    assert adopted, status
    assert all(m["switched_at_pass"] > m["decided_at_pass"] for m in adopted)
    assert any(m["remote_copies"] > 0 for m in adopted)  # weights crossed ranks
    assert _placement(moe_pd["prefill"].base_url)["decisions"]
    assert_idle(moe_pd["decode"].base_url)
