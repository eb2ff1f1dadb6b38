"""Expert parallelism on CPU: a 2-rank tiny Qwen3-MoE server with EPLB answers like transformers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from omni_testing import hf_greedy, post_json

pytestmark = pytest.mark.server

PROMPTS = ["KING RICHARD III:\nNow is the winter of our discontent", "All the world's a stage"]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def moe_server(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from omniinfer.child_process import free_port
    from omniinfer.cpu.server_env import cpu_env
    from omniinfer.testbed.servers import SGLangServer, cpu_server_command

    port = free_port()
    command = cpu_server_command(
        tiny_models["qwen3_moe"], port, max_total_tokens=4096,
        extra_args=[
            "--tp", "2", "--ep", "2",
            "--enable-eplb", "--ep-num-redundant-experts", "2",
            "--eplb-rebalance-num-iterations", "8",
        ],
    )
    log = tmp_path_factory.mktemp("logs") / "moe-server.log"
    with SGLangServer(command, cpu_env(threads_bind="0|1"), log, port) as server:
        yield server


def test_two_rank_moe_matches_transformers_and_rebalances(
    moe_server: Any, tiny_models: dict[str, Path]
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_models["qwen3_moe"])
    for prompt in PROMPTS:
        input_ids = tokenizer.encode(prompt, add_special_tokens=False)
        reply = post_json(
            f"{moe_server.base_url}/generate",
            {
                "input_ids": input_ids,
                "sampling_params": {
                    "max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True,
                },
            },
        )
        assert reply["output_ids"] == hf_greedy(tiny_models["qwen3_moe"], input_ids, NEW_TOKENS)
    log = moe_server.log_path.read_text(errors="replace")
    # Both ranks loaded the plugin, and EPLB moved experts between ranks at least once.
    assert "omniinfer: scheduler tp_rank=0" in log and "omniinfer: scheduler tp_rank=1" in log
    assert "[EPLBManager] rebalance end" in log
