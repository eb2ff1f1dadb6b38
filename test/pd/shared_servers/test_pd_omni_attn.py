"""OmniAttn under real PD: the folder's prefill and decode servers are patterned (as is its
plain server), the sink is sent with the window, greedy outputs equal the plain server's
through OmniProxy oas and the SGLang router, and the decode server holds only sink + window
compressed slots per request."""

from __future__ import annotations

import concurrent.futures
import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from pd_helpers import (
    PATTERN,
    PROMPTS,
    TEXT,
    assert_idle,
    gen_body,
    omniproxy,
    post,
    sglang_router,
)

from omniinfer.attn import runtime_window
from omniinfer.attn.pattern import load

pytestmark = pytest.mark.server

LONG = [TEXT[20000:27500] + "\n\nSummarise the passage above.",
        TEXT[40000:46500] + "\n\nWho speaks in this passage?"]
CASES = [*PROMPTS[:4], *LONG]  # two prompts over 1,500 tokens: windows evicted on decode


@pytest.fixture(scope="module")
def patterned(pd_servers: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
              ) -> dict[str, Any]:
    """The unchunked prefill server, the decode server and the plain server."""
    flags = pd_servers["decode"].command
    assert str(PATTERN) == flags[flags.index("--omni-attn-pattern") + 1]
    return {"prefill": pd_servers["prefill_b"], "decode": pd_servers["decode"],
            "plain": pd_servers["plain"], "logs": tmp_path_factory.mktemp("pd-attn")}


def _status(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/omni/attn", timeout=10) as r:
        return json.loads(r.read())


def _tokens(answer: Any) -> list[int]:
    return answer["output_ids"] if "output_ids" in answer else answer["meta_info"]["output_ids"]


@pytest.fixture(scope="module")
def reference(patterned: dict[str, Any]) -> list[Any]:
    out = []
    for prompt in CASES:
        status, answer = post(patterned["plain"].base_url + "/generate", gen_body(prompt))
        assert status == 200, answer
        out.append(answer)
    lengths = [a["meta_info"]["prompt_tokens"] for a in out]
    assert sum(n > 1500 for n in lengths) >= 2, lengths
    return out


def _check(base_url: str, reference: list[Any], which: list[int] | None = None) -> None:
    """Each case ``which`` names (default: all) answers the reference, streamed and not."""
    for i in range(len(CASES)) if which is None else which:
        prompt, expected = CASES[i], reference[i]
        status, answer = post(base_url + "/generate", gen_body(prompt))
        assert status == 200, answer
        assert answer["text"] == expected["text"], prompt[:40]
        status, raw = post(base_url + "/generate", gen_body(prompt, stream=True))
        events = [json.loads(line[5:]) for line in raw.splitlines()
                  if line.startswith("data:") and line.strip() != "data: [DONE]"]
        assert status == 200 and events[-1]["text"] == expected["text"], prompt[:40]


def test_greedy_outputs_equal_a_patterned_plain_server_through_oas(
        patterned: dict[str, Any], reference: list[Any], smollm2: Path) -> None:
    pair = [patterned["prefill"], patterned["decode"]]
    with omniproxy(pair, "oas", smollm2, patterned["logs"]) as router:
        _check(router.base_url, reference)
    attn = _status(patterned["prefill"].base_url)["pd_transfer"]
    assert attn["sink_pages"] > 0 and attn["requests"] >= 2 * len(CASES)
    assert attn["full_layer_bytes"] + attn["compressed_layer_bytes"] < attn["bytes_without_pattern"]
    assert_idle(patterned["decode"].base_url)


def test_greedy_outputs_equal_through_the_sglang_router(
        patterned: dict[str, Any], reference: list[Any]) -> None:
    # one short prompt and the two long ones (the short ones are the OAS test's; here the
    # router, not the prompt, is what differs)
    with sglang_router([patterned["prefill"], patterned["decode"]], patterned["logs"]) as router:
        _check(router.base_url, reference, [0, len(CASES) - 2, len(CASES) - 1])


def test_decode_server_holds_only_sink_and_window_per_request(
        patterned: dict[str, Any], smollm2: Path) -> None:
    pattern = load(PATTERN)
    per_request = pattern.sink + pattern.recent + runtime_window.EVICTION_INTERVAL + 1
    decode = patterned["decode"].base_url
    samples: list[tuple[int, int]] = []
    pair = [patterned["prefill"], patterned["decode"]]
    with omniproxy(pair, "oas", smollm2, patterned["logs"]) as router, \
            concurrent.futures.ThreadPoolExecutor(3) as pool:
        jobs = [pool.submit(post, router.base_url + "/generate",
                            gen_body(prompt, max_new_tokens=64)) for prompt in [*LONG, LONG[0]]]
        while not all(j.done() for j in jobs):
            with urllib.request.urlopen(decode + "/v1/loads", timeout=10) as r:
                running = sum(x["num_running_reqs"] for x in json.loads(r.read())["loads"])
            used = _status(decode)["usage"]["compressed_tokens_used"]
            samples.append((running, used))
            time.sleep(0.05)
        assert all(j.result()[0] == 200 for j in jobs)
    decoding = sorted(u for r, u in samples if r == 3)  # all three past their transfer
    assert decoding, samples
    # the status is rewritten twice a second: the median reading is a settled one
    assert decoding[0] <= 3 * per_request and decoding[len(decoding) // 2] <= 3 * per_request, \
        (per_request, samples)
    assert_idle(decode)
