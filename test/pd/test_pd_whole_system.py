"""The whole system on real PD: SmolLM2-MoE prefill and decode servers with expert parallelism
(``--tp 2 --ep 2``, two ranks each, two redundant experts), the placement controller and the
OmniAttn pattern on both, OmniProxy (oas) in front. Migrations are decided, staged and switched
in on the decode server while PD traffic runs; greedy outputs equal the dense SmolLM2's in
transformers token for token (short prompts: nothing to evict) and, for a prompt longer than
sink + window, the dense model's with a really evicting cache; the decode server holds only
sink + window compressed slots per request.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from pd_helpers import START, TEXT, assert_idle, omniproxy, post

from omni_testing import ROOT, hf_greedy
from omniinfer.attn import decode
from omniinfer.attn.pattern import load
from omniinfer.cpu.server_env import cpu_env
from omniinfer.testbed.pd_servers import pd_server, started

pytestmark = pytest.mark.server

DENSE = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"
MOE = ROOT / ".cache" / "models" / "SmolLM2-135M-MoE"
PATTERN = ROOT / "python" / "omniinfer" / "attn" / "patterns" / "smollm2-135m-moe.json"
FLAGS = ["--tp", "2", "--ep", "2", "--ep-num-redundant-experts", "2",
         "--enable-omni-placement", "--omni-placement-interval", "4",
         "--omni-placement-trigger", "1.02", "--omni-placement-margin", "0.01",
         "--omni-attn-pattern", str(PATTERN)]
TEXTS = ["O Romeo, Romeo! wherefore art thou Romeo? " * 2, "Now is the winter of our discontent",
         "To be, or not to be, that is the question"]
LONG = TEXT[START + 8000:START + 11200] + "\n\nWho is the speaker?"  # 903 tokens: > sink + window
NEW_TOKENS = 12
ROUNDS = 4


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    if not (MOE / "config.json").is_file():
        pytest.fail(f"{MOE} is missing: scripts/setup.sh builds it")
    logs = tmp_path_factory.mktemp("pd-system")
    servers = [pd_server(MOE, mode, logs, 8192, FLAGS, f"system-{mode}")
               for mode in ("prefill", "decode")]
    for server in servers:
        server.env = cpu_env(server.env, threads_bind="0|1")
    with started(servers):
        yield {"prefill": servers[0], "decode": servers[1], "logs": logs}


def _get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def _generate(router_url: str, ids: list[int], stream: bool = False) -> list[int]:
    status, answer = post(router_url + "/generate", {
        "input_ids": ids, "sampling_params": {
            "max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}})
    assert status == 200, answer
    return answer["output_ids"]


def test_placement_migrates_and_the_pattern_holds_under_pd_with_oas(
        system: dict[str, Any]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DENSE)
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    expected = [hf_greedy(DENSE, ids, NEW_TOKENS) for ids in prompts]
    long_ids = tokenizer.encode(LONG, add_special_tokens=False)
    pattern = load(PATTERN)
    assert len(long_ids) > pattern.sink + pattern.recent + NEW_TOKENS
    dense = AutoModelForCausalLM.from_pretrained(DENSE, dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    long_expected = decode.greedy(dense, long_ids, NEW_TOKENS, pattern.mask, pattern.sink,
                                  pattern.recent)
    assert long_expected != hf_greedy(DENSE, long_ids, NEW_TOKENS)  # the pattern matters here
    pair = [system["prefill"], system["decode"]]
    with omniproxy(pair, "oas", MOE, system["logs"]) as router:
        for round_ in range(ROUNDS):  # before, during and after migrations
            for ids, want in zip(prompts, expected, strict=True):
                assert _generate(router.base_url, ids) == want, f"round {round_}"
        assert _generate(router.base_url, long_ids) == long_expected
    placement = _get(system["decode"].base_url + "/omni/placement")
    adopted = [m for m in placement["migrations"] if m["state"] == "adopted"]
    assert adopted, placement
    assert all(m["switched_at_pass"] > m["decided_at_pass"] for m in adopted)
    assert any(m["remote_copies"] > 0 for m in adopted)  # weights crossed ranks
    assert _get(system["prefill"].base_url + "/omni/placement")["decisions"]
    attn = _get(system["decode"].base_url + "/omni/attn")
    assert attn["enabled"] and attn["pattern"]["sink"] == pattern.sink
    sent = _get(system["prefill"].base_url + "/omni/attn")["pd_transfer"]
    assert sent["requests"] >= ROUNDS * len(TEXTS) + 1
    assert sent["compressed_layer_bytes"] < sent["bytes_without_pattern"] - sent[
        "full_layer_bytes"]  # the long prompt's compressed layers sent sink + window only
    assert_idle(system["decode"].base_url)
