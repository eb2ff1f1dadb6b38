"""Real 1P1D and 2P1D: greedy outputs through OmniProxy and the SGLang router equal a plain server's.

KV moves from the prefill server to the decode server over Mooncake's TCP transport; the plugin
supplies the CPU defaults, the servers are started with the stock commands.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pd_helpers import (
    PROMPTS,
    assert_idle,
    gen_body,
    omniproxy,
    post,
    run,
    sglang_router,
    stream_text,
)

pytestmark = pytest.mark.server

OPENAI_CASES: dict[str, dict[str, Any]] = {
    "/v1/completions": {"model": "default", "prompt": PROMPTS[3], "max_tokens": 16,
                        "temperature": 0.0},
    "/v1/chat/completions": {"model": "default", "max_tokens": 16, "temperature": 0.0,
                             "messages": [{"role": "user", "content": "Name a large ocean."}]},
}


@pytest.fixture(scope="module")
def reference(pd_servers: dict[str, Any]) -> dict[str, Any]:
    """Greedy answers of the plain (non-PD) server: the truth every PD path must equal."""
    plain = pd_servers["plain"].base_url
    out: dict[str, Any] = {}
    for i, prompt in enumerate(PROMPTS):
        status, body = post(plain + "/generate", gen_body(prompt))
        assert status == 200, body
        out[f"gen{i}"] = body
    for path, body in OPENAI_CASES.items():
        status, answer = post(plain + path, body)
        assert status == 200, answer
        out[path] = answer
    return out


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pd-routers")


def _check_generate(base_url: str, reference: dict[str, Any]) -> None:
    for i, prompt in enumerate(PROMPTS):
        expected = reference[f"gen{i}"]
        status, body = post(base_url + "/generate", gen_body(prompt))
        assert status == 200, body
        assert body["output_ids"] == expected["output_ids"], f"prompt {i}"
        status, events = stream_text(base_url + "/generate", gen_body(prompt))
        assert status == 200 and events[-1] == "[DONE]", events[-3:]
        assert not any(isinstance(e, dict) and "error" in e for e in events), events[-3:]
        assert events[-2]["text"] == expected["text"], f"prompt {i} (stream)"


def _choice_text(answer: dict[str, Any], path: str) -> str:
    choice = answer["choices"][0]
    return str(choice["text"] if path == "/v1/completions" else choice["message"]["content"])


def _stream_choice_text(events: list[Any], path: str) -> str:
    parts = []
    for event in events:
        if isinstance(event, dict) and event.get("choices"):
            choice = event["choices"][0]
            piece = choice.get("text") if path == "/v1/completions" else (
                choice.get("delta") or {}).get("content")
            parts.append(piece or "")
    return "".join(parts)


def test_reference_covers_a_long_prompt(reference: dict[str, Any]) -> None:
    assert reference[f"gen{len(PROMPTS) - 1}"]["meta_info"]["prompt_tokens"] >= 1000
    assert all(len(reference[f"gen{i}"]["output_ids"]) == 24 for i in range(len(PROMPTS)))


@pytest.mark.parametrize("policy", ["round_robin", "cache_aware", "oas"])
def test_omniproxy_1p1d_generate_equals_plain(pd_servers: dict[str, Any], smollm2: Path,
                                              reference: dict[str, Any], logs: Path,
                                              policy: str) -> None:
    p, d = pd_servers["prefill_a"], pd_servers["decode"]
    with omniproxy([p, d], policy, smollm2, logs) as router:
        _check_generate(router.base_url, reference)
    assert_idle(p.base_url)
    assert_idle(d.base_url)


def test_omniproxy_1p1d_openai_and_batch_equal_plain(pd_servers: dict[str, Any], smollm2: Path,
                                                     reference: dict[str, Any],
                                                     logs: Path) -> None:
    p, d = pd_servers["prefill_a"], pd_servers["decode"]
    with omniproxy([p, d], "cache_aware", smollm2, logs) as router:
        for path, body in OPENAI_CASES.items():
            status, answer = post(router.base_url + path, body)
            assert status == 200, answer
            assert _choice_text(answer, path) == _choice_text(reference[path], path)
            status, events = stream_text(router.base_url + path, body)
            assert status == 200 and events[-1] == "[DONE]"
            assert _stream_choice_text(events, path) == _choice_text(reference[path], path)
        batch = PROMPTS[:3]
        status, answers = post(router.base_url + "/generate", gen_body(batch))
        assert status == 200, answers
        assert [a["output_ids"] for a in answers] == [
            reference[f"gen{i}"]["output_ids"] for i in range(len(batch))]
    assert_idle(p.base_url)
    assert_idle(d.base_url)


def test_sglang_router_1p1d_equals_plain(pd_servers: dict[str, Any], reference: dict[str, Any],
                                         logs: Path) -> None:
    """The peer: the real sglang-router in PD mode in front of the same real servers."""
    p, d = pd_servers["prefill_a"], pd_servers["decode"]
    with sglang_router([p, d], logs) as router:
        _check_generate(router.base_url, reference)
        path = "/v1/chat/completions"
        status, answer = post(router.base_url + path, OPENAI_CASES[path])
        assert status == 200, answer
        assert _choice_text(answer, path) == _choice_text(reference[path], path)
    assert_idle(p.base_url)
    assert_idle(d.base_url)


def test_bench_through_oas_on_2p1d(pd_servers: dict[str, Any], smollm2: Path, logs: Path,
                                   tmp_path: Path) -> None:
    """``omniinfer bench`` through OAS on two real prefill servers: nothing lost, no 5xx."""
    servers = [pd_servers["prefill_a"], pd_servers["prefill_b"], pd_servers["decode"]]
    from omniinfer.testbed.pd_servers import load

    before = {s.base_url: load(s.base_url)["total_prefill_uncached_tokens"] for s in servers[:2]}
    with omniproxy(servers, "oas", smollm2, logs) as router:
        import sys

        result = run([sys.executable, "-m", "omniinfer", "bench", "--base-url", router.base_url,
                      "--tokenizer", str(smollm2), "--workload", "random", "--input-len", "256",
                      "--output-len", "16", "--concurrency", "4", "--num-requests", "8",
                      "--output-dir", str(tmp_path), "--no-progress"], timeout=600)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    records = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert len(records) == 8
    assert summary["completed"] == 8 and summary["errors"] == 0, summary
    assert all(r.get("error") in (None, "") for r in records), [r.get("error") for r in records]
    after = {s.base_url: load(s.base_url)["total_prefill_uncached_tokens"] for s in servers[:2]}
    assert all(after[u] > before[u] for u in after), (before, after)  # both prefills worked
    for server in servers:
        assert_idle(server.base_url)
