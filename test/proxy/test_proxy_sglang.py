"""Regular mode end to end: the router in front of one real SGLang CPU server (tiny Llama)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from proxy_helpers import get, post, sse_events

from omniinfer.proxy.process import RouterProcess

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def router(llama_server: Any, tiny_models: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    tmp = tmp_path_factory.mktemp("router-sglang")
    args = ["--worker-urls", llama_server.base_url, "--model-path", str(tiny_models["llama"]),
            "--access-log", str(tmp / "access.jsonl"), "--apc-block-size", "8"]
    with RouterProcess(args, tmp / "router.log") as proc:
        proc.access_log = tmp / "access.jsonl"  # type: ignore[attr-defined]
        yield proc


CASES = {
    "/generate": {"text": "The quick brown fox", "sampling_params": {
        "max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}},
    "/v1/completions": {"prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0.0,
                        "model": "default"},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Say something"}],
                             "max_tokens": 6, "temperature": 0.0, "model": "default"},
}


@pytest.mark.parametrize("path", list(CASES))
def test_sglang_endpoints_match_direct_answers(router: RouterProcess, llama_server: Any,
                                               path: str) -> None:
    direct_status, direct, _ = post(llama_server.base_url + path, CASES[path])
    status, answer, _ = post(router.base_url + path, CASES[path])
    assert status == direct_status == 200, answer
    if path == "/generate":
        assert answer["text"] == direct["text"] and answer["meta_info"]["completion_tokens"] == 6
    else:
        key = "text" if path == "/v1/completions" else "message"
        assert answer["choices"][0][key] == direct["choices"][0][key]
    status, text, _ = post(router.base_url + path, dict(CASES[path], stream=True))
    assert status == 200
    events = sse_events(text)
    assert events[-1] == "[DONE]" and len(events) >= 3
    assert not any(isinstance(e, dict) and "error" in e for e in events)
    if path == "/generate":
        assert events[-2]["text"] == direct["text"]  # SGLang streams the cumulative text
    else:
        pieces = [e["choices"][0].get("text") or e["choices"][0].get("delta", {}).get("content")
                  or "" for e in events[:-1] if e.get("choices")]
        expected = direct["choices"][0].get("text") or direct["choices"][0]["message"]["content"]
        assert "".join(pieces) == expected


def test_sglang_info_endpoints_and_flush(router: RouterProcess) -> None:
    assert get(router.base_url + "/health")[0] == 200
    status, models = get(router.base_url + "/v1/models")
    assert status == 200 and models["data"]
    status, info = get(router.base_url + "/server_info")
    assert status == 200 and "max_total_num_tokens" in info or "internal_states" in info
    assert info["omniproxy"]["tokenizer"] == "hf"
    assert get(router.base_url + "/model_info")[0] == 200
    status, flushed, _ = post(router.base_url + "/flush_cache", {})
    assert status == 200 and flushed["success"]
    status, metrics = get(router.base_url + "/metrics")
    assert "omniproxy_worker_kv_usage" in metrics and "omniproxy_phase_duration_seconds" in metrics


def test_sglang_bad_input_is_one_clear_error(router: RouterProcess) -> None:
    status, answer, _ = post(router.base_url + "/generate", None, raw=b"{not json")
    assert status == 400 and "not valid JSON" in answer["error"]["message"]
    status, answer, _ = post(router.base_url + "/generate", {"text": 42})
    assert status == 400 and "'text'" in answer["error"]["message"]
    status, answer, _ = post(router.base_url + "/v1/chat/completions", {"messages": []})
    assert status == 400


def test_router_prefix_prediction_matches_worker_cache(router: RouterProcess) -> None:
    """The router's predicted cached tokens never exceed what SGLang reports it reused."""
    prompt = "Once upon a time in a land far away there lived a small dragon " * 3
    body = {"text": prompt, "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}
    post(router.base_url + "/generate", body)
    status, answer, _ = post(router.base_url + "/generate", body)
    assert status == 200
    worker_cached = answer["meta_info"]["cached_tokens"]
    time.sleep(1.1)  # the access log is flushed at most every second
    post(router.base_url + "/generate", {"text": "flush", "sampling_params": {"max_new_tokens": 1}})
    records = [json.loads(line) for line in router.access_log.read_text().splitlines()]  # type: ignore[attr-defined]
    mine = [r for r in records if r.get("prompt_tokens") == answer["meta_info"]["prompt_tokens"]]
    predicted = mine[-1]["decisions"][0]["cached_tokens"]
    assert predicted > 0 and predicted <= worker_cached
    assert worker_cached - predicted < 8  # at most one partial block apart


def test_bench_through_router_loses_no_request(router: RouterProcess, tiny_models: dict[str, Path],
                                               tmp_path: Path) -> None:
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, "-m", "omniinfer", "bench", "--base-url", router.base_url,
         "--tokenizer", str(tiny_models["llama"]), "--num-requests", "8", "--concurrency", "4",
         "--input-len", "32", "--output-len", "8", "--no-progress", "--output-dir", str(out)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] == 8 and summary["errors"] == 0
