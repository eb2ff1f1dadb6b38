"""SmolLM2-MoE on the real SGLang engine: served as qwen2_moe (4 experts, top 2, skewed router),
its greedy outputs equal the dense SmolLM2's in transformers token for token, and SGLang's
expert-distribution recorder sees an uneven, real load."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest

from omni_testing import ROOT, hf_greedy, post_json

pytestmark = pytest.mark.server

DENSE = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"
MOE = ROOT / ".cache" / "models" / "SmolLM2-135M-MoE"
TEXTS = ["The capital of France is", "def fibonacci(n):",
         "Once upon a time, in a small village by the sea,"]
NEW_TOKENS = 16


def _post(url: str) -> None:
    request = urllib.request.Request(url, data=b"{}", method="POST")
    with urllib.request.urlopen(request, timeout=60) as r:
        r.read()


def _prompts_and_dense_outputs() -> tuple[list[list[int]], list[list[int]]]:
    """The prompts' token ids and the dense model's greedy continuations in transformers."""
    from transformers import AutoTokenizer

    if not (MOE / "config.json").is_file():
        pytest.fail(f"{MOE} is missing: scripts/setup.sh builds it")
    tokenizer = AutoTokenizer.from_pretrained(DENSE)
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    return prompts, [hf_greedy(DENSE, ids, NEW_TOKENS) for ids in prompts]


def test_moe_outputs_equal_the_dense_model_and_the_load_is_uneven(tmp_path: Path) -> None:
    from omniinfer.child_process import free_port
    from omniinfer.cpu.server_env import cpu_env
    from omniinfer.testbed.servers import SGLangServer, cpu_server_command

    prompts, expected = _prompts_and_dense_outputs()
    port = free_port()
    command = cpu_server_command(MOE, port, 4096,
                                 ["--expert-distribution-recorder-mode", "stat"])
    env = cpu_env()
    env["SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR"] = str(tmp_path / "dumps")
    with SGLangServer(command, env, tmp_path / "moe.log", port) as server:
        _post(server.base_url + "/start_expert_distribution_record")
        for ids, want in zip(prompts, expected, strict=True):
            reply = post_json(server.base_url + "/generate", {
                "input_ids": ids, "sampling_params": {
                    "max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}})
            assert reply["output_ids"] == want
        _post(server.base_url + "/stop_expert_distribution_record")
        with urllib.request.urlopen(urllib.request.Request(
                server.base_url + "/dump_expert_distribution_record", data=b"{}",
                method="POST"), timeout=60) as r:
            r.read()
    import torch

    (dump,) = (tmp_path / "dumps").glob("expert_distribution_recorder_*.pt")
    counts = torch.load(dump, weights_only=False)["logical_count"]
    per_expert = counts.sum(dim=tuple(range(counts.dim() - 1))).float()  # [experts]
    assert counts.shape[-2:] == (30, 4) and per_expert.sum() > 0
    assert per_expert.max() > 1.3 * per_expert.min(), per_expert  # real, uneven load


def test_sglang_eplb_rebalances_the_qwen2_moe_model(tmp_path: Path) -> None:
    """SGLang's own ``--enable-eplb`` on SmolLM2-MoE (qwen2_moe, which publishes no
    ``routed_experts_weights_of_layer``): before the plugin's EPLB adapter its first rebalance
    died with AttributeError; now EPLB rebalances (SGLang's own log line, more than once) and
    the greedy outputs stay the dense model's."""
    from omniinfer.child_process import free_port
    from omniinfer.cpu.server_env import cpu_env
    from omniinfer.testbed.servers import SGLangServer, cpu_server_command

    prompts, expected = _prompts_and_dense_outputs()
    port = free_port()
    command = cpu_server_command(MOE, port, 4096, [
        "--tp", "2", "--ep", "2", "--enable-eplb", "--ep-num-redundant-experts", "2",
        "--eplb-rebalance-num-iterations", "8"])
    log = tmp_path / "moe-eplb.log"
    with SGLangServer(command, cpu_env(threads_bind="0|1"), log, port,
                      ready_timeout_s=900) as server:
        for ids, want in zip(prompts, expected, strict=True):
            reply = post_json(server.base_url + "/generate", {
                "input_ids": ids, "sampling_params": {
                    "max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}})
            assert reply["output_ids"] == want
    text = log.read_text(errors="replace")
    assert "AttributeError" not in text
    assert "built from its MoE layers for SGLang's EPLB" in text
    assert text.count("[EPLBManager] rebalance end") >= 2, text[-3000:]
