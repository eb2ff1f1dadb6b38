"""OmniPlacement in a real 2-rank SGLang MoE server: adopted migrations, unchanged outputs."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from omni_testing import hf_greedy, post_json

pytestmark = pytest.mark.server

NEW_TOKENS = 12


def test_migrations_adopted_and_outputs_equal_transformers(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    from omniinfer.child_process import free_port
    from omniinfer.cpu.server_env import cpu_env
    from omniinfer.testbed.servers import SGLangServer, cpu_server_command

    port = free_port()
    command = cpu_server_command(
        tiny_models["qwen3_moe"], port, max_total_tokens=4096,
        extra_args=[
            "--tp", "2", "--ep", "2", "--ep-num-redundant-experts", "2",
            "--enable-omni-placement", "--omni-placement-interval", "4",
            "--omni-placement-trigger", "1.02", "--omni-placement-margin", "0.01",
        ],
    )
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["qwen3_moe"])
    skewed = tokenizer.encode("O Romeo, Romeo! wherefore art thou Romeo? " * 2, add_special_tokens=False)
    other = tokenizer.encode("Now is the winter of our discontent", add_special_tokens=False)
    expected = {
        "skewed": hf_greedy(tiny_models["qwen3_moe"], skewed, NEW_TOKENS),
        "other": hf_greedy(tiny_models["qwen3_moe"], other, NEW_TOKENS),
    }
    env = cpu_env(threads_bind="0|1")
    with SGLangServer(command, env, tmp_path / "server.log", port) as server:
        for round_ in range(4):  # before, during and after migrations
            for name, ids in (("skewed", skewed), ("skewed", skewed), ("other", other)):
                reply = post_json(f"{server.base_url}/generate", {
                    "input_ids": ids,
                    "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0.0,
                                        "ignore_eos": True},
                })
                assert reply["output_ids"] == expected[name], f"round {round_}, {name}"
        with urllib.request.urlopen(f"{server.base_url}/omni/placement", timeout=30) as response:
            status = json.loads(response.read())
    adopted = [m for m in status["migrations"] if m["state"] == "adopted"]
    assert adopted, status
    assert all(m["switched_at_pass"] > m["decided_at_pass"] for m in adopted)
    assert any(m["remote_copies"] > 0 for m in adopted)  # weights crossed ranks
    assert status["decisions"] and set(status["layer_imbalance"]) == {"0", "1"}
    # SGLang's own fixed-period rebalance never ran: the controller replaced it.
    assert "[EPLBManager] rebalance start" not in (tmp_path / "server.log").read_text()
