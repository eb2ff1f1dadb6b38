"""Real PD with data-parallel servers: a ``--dp-size 2`` prefill and a ``--dp-size 2`` decode
server, OmniProxy ``--dp-aware`` in front. Greedy outputs equal transformers' (the reference of
the plain-server tests, so no third server starts here), every rank of both servers is used (by
the router's count and by SGLang's own per-rank counters), and nothing is left held anywhere.
SGLang's DP controller sleeps while idle (the CPU plugin's fix)."""

from __future__ import annotations

import concurrent.futures
import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from pd_helpers import MAX_NEW_TOKENS, PROMPTS, assert_idle, gen_body, omniproxy, post, stream_text

from omni_testing import hf_greedy
from omniinfer.cpu.server_env import cpu_env
from omniinfer.testbed.pd_servers import pd_server, started

pytestmark = pytest.mark.server
MAX_TOTAL_TOKENS = 4096
RANKS = 2


@pytest.fixture(scope="module")
def dp_servers(smollm2: Path, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[dict[str, Any]]:
    logs = tmp_path_factory.mktemp("pd-dp-logs")
    dp = ["--dp-size", str(RANKS)]
    servers = {"prefill": pd_server(smollm2, "prefill", logs, MAX_TOTAL_TOKENS, dp, "prefill-dp"),
               "decode": pd_server(smollm2, "decode", logs, MAX_TOTAL_TOKENS, dp, "decode-dp")}
    for name in ("prefill", "decode"):  # one OpenMP group per rank
        servers[name].env = cpu_env(threads_bind="|".join(str(c) for c in range(RANKS)))
    with started(list(servers.values())):
        yield servers


def _rank_counters(url: str) -> dict[int, dict[str, Any]]:
    with urllib.request.urlopen(url + "/v1/loads", timeout=10) as resp:
        entries = json.loads(resp.read())["loads"]
    return {e["dp_rank"]: e for e in entries}


def _controllers(server: Any) -> list[psutil.Process]:
    children = psutil.Process(server.process.pid).children(recursive=True)
    return [p for p in children if "data_parallel_controller" in " ".join(p.cmdline()) + p.name()]


def test_an_idle_dp_controller_sleeps(dp_servers: dict[str, Any]) -> None:
    """Before the fix each DP controller took a whole core while idle (10 core-s per 10 s)."""
    for name in ("prefill", "decode"):
        controllers = _controllers(dp_servers[name])
        assert len(controllers) == 1, controllers
        before = sum(controllers[0].cpu_times()[:2])
        time.sleep(3.0)
        used = sum(controllers[0].cpu_times()[:2]) - before
        assert used < 0.5, f"{name}: the idle DP controller used {used:.2f} CPU-s in 3 s"


def test_dp_aware_pd_outputs_equal_transformers_and_every_rank_serves(
        dp_servers: dict[str, Any], smollm2: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)  # SGLang encodes a text prompt this way
    reference = [hf_greedy(smollm2, tokenizer.encode(prompt), MAX_NEW_TOKENS)
                 for prompt in PROMPTS]
    prefill, decode = dp_servers["prefill"], dp_servers["decode"]
    before = _rank_counters(prefill.base_url)
    with omniproxy([prefill, decode], "oas", smollm2, tmp_path, ["--dp-aware"]) as router:
        base = router.base_url
        for prompt, expected in zip(PROMPTS, reference, strict=True):
            status, body = post(base + "/generate", gen_body(prompt))
            assert status == 200, body
            assert body["output_ids"] == expected, prompt[:40]
            status, events = stream_text(base + "/generate", gen_body(prompt))
            assert status == 200 and events[-1] == "[DONE]", events[-3:]
            assert events[-2]["text"] == body["text"], prompt[:40]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:  # a burst: ranks share it
            answers = list(pool.map(lambda p: post(base + "/generate", gen_body(p)),
                                    PROMPTS[:4] * 2))
        for (status, body), expected in zip(answers, reference[:4] * 2, strict=True):
            assert status == 200 and body["output_ids"] == expected
        with urllib.request.urlopen(base + "/list_workers", timeout=10) as resp:
            workers = {w["role"]: w for w in json.loads(resp.read())["workers"]}
    for role in ("prefill", "decode"):
        assert workers[role]["dp_size"] == RANKS, workers[role]
        assert min(workers[role]["rank_requests"]) >= 4, workers[role]
        assert workers[role]["rank_inflight_tokens"] == [0] * RANKS
    after = _rank_counters(prefill.base_url)
    computed = [after[r]["total_prefill_uncached_tokens"]
                - before[r]["total_prefill_uncached_tokens"] for r in range(RANKS)]
    assert min(computed) > 0, computed  # SGLang itself ran prompts on every rank
    assert_idle(prefill.base_url)
    assert_idle(decode.base_url)
