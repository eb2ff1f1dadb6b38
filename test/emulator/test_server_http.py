"""HTTP shapes of a live emulated worker, compared with responses captured from real SGLang 0.5.23."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
from emu_helpers import request, sse_events, start_emulator, wait_until
from prometheus_client.parser import text_string_to_metric_families

from omniinfer.emulator.process import EmulatorProcess
from omniinfer.emulator.profile import load_profile

GEN = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}
CHAT = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMP = {"model": "default", "prompt": "The capital of France is", "max_tokens": 4}


def keys(obj: Any) -> set[str]:
    return set(obj) if isinstance(obj, dict) else set()


def test_generate_matches_real_shape(emulator: EmulatorProcess, capture: dict[str, Any]) -> None:
    status, text = request(f"{emulator.url}/generate", "POST", GEN)
    assert status == 200
    got, real = json.loads(text), capture["generate"]["json"]
    assert keys(got) == keys(real)
    assert keys(got["meta_info"]) == keys(real["meta_info"])
    assert got["meta_info"]["completion_tokens"] == 4 and len(got["output_ids"]) == 4
    assert got["meta_info"]["finish_reason"] == {"type": "length", "length": 4}


def test_generate_stream_matches_real_shape(emulator: EmulatorProcess, capture: dict[str, Any]) -> None:
    status, text = request(f"{emulator.url}/generate", "POST", {**GEN, "stream": True})
    assert status == 200
    events, real = sse_events(text), capture["generate_stream"]["events"]
    assert events[-1] == "[DONE]" and real[-1] == "[DONE]"
    chunks, real_chunks = [json.loads(e) for e in events[:-1]], [json.loads(e) for e in real[:-1]]
    assert [c["meta_info"]["completion_tokens"] for c in chunks] == [1, 2, 3, 4]
    assert keys(chunks[1]["meta_info"]) == keys(real_chunks[1]["meta_info"])  # a middle chunk
    assert keys(chunks[-1]["meta_info"]) == keys(real_chunks[-1]["meta_info"])  # the final one
    assert chunks[-1]["text"].startswith(chunks[0]["text"])  # cumulative, as SGLang streams


def test_generate_batch_and_input_ids(emulator: EmulatorProcess, capture: dict[str, Any]) -> None:
    status, text = request(f"{emulator.url}/generate", "POST", {**GEN, "text": ["a b", "c d"]})
    assert status == 200 and isinstance(json.loads(text), list) and len(json.loads(text)) == 2
    status, text = request(f"{emulator.url}/generate", "POST",
                           {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 3}})
    assert status == 200 and json.loads(text)["meta_info"]["prompt_tokens"] == 4


@pytest.mark.parametrize("name,path,body", [
    ("completions", "/v1/completions", COMP),
    ("chat", "/v1/chat/completions", CHAT),
])
def test_openai_matches_real_shape(emulator: EmulatorProcess, capture: dict[str, Any], name: str, path: str,
                                   body: dict[str, Any]) -> None:
    status, text = request(emulator.url + path, "POST", body)
    got, real = json.loads(text), capture[name]["json"]
    assert status == 200
    assert keys(got) == keys(real)
    assert keys(got["choices"][0]) == keys(real["choices"][0])
    assert keys(got["usage"]) == keys(real["usage"])
    assert got["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("name,path,body", [
    ("completions_stream", "/v1/completions", {**COMP, "stream": True}),
    ("chat_stream", "/v1/chat/completions", {**CHAT, "stream": True}),
    ("chat_stream_usage", "/v1/chat/completions",
     {**CHAT, "stream": True, "stream_options": {"include_usage": True}}),
])
def test_openai_stream_matches_real_shape(emulator: EmulatorProcess, capture: dict[str, Any], name: str, path: str,
                                          body: dict[str, Any]) -> None:
    status, text = request(emulator.url + path, "POST", body)
    assert status == 200
    events, real = sse_events(text), capture[name]["events"]
    assert events[-1] == "[DONE]"
    got, want = [json.loads(e) for e in events[:-1]], [json.loads(e) for e in real[:-1]]
    # the real server may merge tokens into one chunk; compare the shape of each kind of chunk
    pairs = [(got[0], want[0]), (got[1], want[1]), (got[-1], want[-1]), (got[-2], want[-2])]
    for g, w in pairs:
        assert keys(g) == keys(w)
        if g["choices"]:
            assert keys(g["choices"][0]) == keys(w["choices"][0])
            assert keys(g["choices"][0].get("delta")) == keys(w["choices"][0].get("delta"))
            assert g["choices"][0]["finish_reason"] == w["choices"][0]["finish_reason"]
    content_chunks = [g for g in got if g["choices"] and (g["choices"][0].get("delta", {}).get("content")
                                                          or g["choices"][0].get("text"))]
    assert len(content_chunks) == 4  # the emulator at this pace: one chunk per token


def test_status_endpoints_match_real_shape(emulator: EmulatorProcess, capture: dict[str, Any]) -> None:
    for path in ("/health", "/health_generate"):
        assert request(emulator.url + path) == (200, "")
    status, text = request(emulator.url + "/model_info")
    real = capture["model_info"]["json"]
    assert status == 200 and keys(json.loads(text)) == keys(real) - {"embedding"}
    status, text = request(emulator.url + "/server_info")
    info, real = json.loads(text), capture["server_info"]["json"]
    assert status == 200 and keys(real) <= keys(info)
    assert keys(real["internal_states"][0]) <= keys(info["internal_states"][0])
    assert info["max_total_num_tokens"] == 16384 and info["disaggregation_mode"] == "null"
    status, text = request(emulator.url + "/v1/loads")
    loads, real = json.loads(text), capture["v1_loads"]["json"]
    assert status == 200 and keys(loads) == keys(real)
    assert keys(loads["loads"][0]) == keys(real["loads"][0])
    for section in ("memory", "disaggregation", "queues"):
        assert keys(loads["loads"][0][section]) == keys(real["loads"][0][section])
    status, text = request(emulator.url + "/v1/loads?include=core")
    assert status == 200 and "memory" not in json.loads(text)["loads"][0]


def test_metrics_use_sglang_names(emulator: EmulatorProcess, capture: dict[str, Any]) -> None:
    request(emulator.url + "/generate", "POST", {**GEN, "stream": True})
    status, text = request(emulator.url + "/metrics")
    assert status == 200
    families = list(text_string_to_metric_families(text))
    assert all(f.documentation for f in families)  # a HELP line for every series
    names = {s.name for f in families for s in f.samples}
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage",
                 "sglang:cache_hit_rate", "sglang:gen_throughput", "sglang:prompt_tokens_total",
                 "sglang:generation_tokens_total", "sglang:time_to_first_token_seconds_bucket",
                 "sglang:inter_token_latency_seconds_count", "sglang:e2e_request_latency_seconds_sum",
                 "sglang:http_requests_total"):
        assert name in names
    assert names <= set(capture["metrics_names"])  # nothing the real server does not export
    streamed = [s for f in families for s in f.samples
                if s.name == "sglang:generation_tokens_total" and s.labels["is_streaming"] == "true"]
    assert streamed and streamed[0].value >= 4 and streamed[0].labels["engine_type"] == "unified"


def test_flush_cache_and_abort(emulator: EmulatorProcess, capture: dict[str, Any]) -> None:
    status, text = request(emulator.url + "/flush_cache", "POST")
    assert status == 200 and text == capture["flush_cache"]["text"]
    assert request(emulator.url + "/abort_request", "POST", {"rid": "nope"}) == (200, "")
    # abort a long running request by rid: it finishes with an abort reason
    result: dict[str, Any] = {}

    def long_request() -> None:
        body = {**GEN, "rid": "to-abort", "sampling_params": {"max_new_tokens": 10000}}
        result["response"] = request(emulator.url + "/generate", "POST", body)

    thread = threading.Thread(target=long_request)
    thread.start()
    assert wait_until(lambda: emulator.load()["num_running_reqs"] == 1)  # it runs: abort it
    assert request(emulator.url + "/abort_request", "POST", {"rid": "to-abort"})[0] == 200
    thread.join(timeout=20)
    status, text = result["response"]
    assert status == 200 and json.loads(text)["meta_info"]["finish_reason"]["type"] == "abort"


def test_prefix_cache_reported(emulator: EmulatorProcess) -> None:
    prompt = "shared prefix " * 50
    request(emulator.url + "/generate", "POST", {"text": prompt + "one", "sampling_params": {"max_new_tokens": 1}})
    _, text = request(emulator.url + "/generate", "POST",
                      {"text": prompt + "two", "sampling_params": {"max_new_tokens": 1}})
    assert json.loads(text)["meta_info"]["cached_tokens"] >= 100


BAD = [
    ("/generate", b"{not json"),
    ("/generate", b"[1, 2]"),
    ("/generate", b"{}"),
    ("/generate", json.dumps({"text": "x", "sampling_params": {"max_new_tokens": "many"}}).encode()),
    ("/generate", json.dumps({"text": 5}).encode()),
    ("/generate", json.dumps({"input_ids": ["a"]}).encode()),
    ("/generate", json.dumps({"text": "x", "sampling_params": []}).encode()),
    ("/generate", json.dumps({"text": "x", "sampling_params": {"max_new_tokens": -1}}).encode()),
    ("/generate", json.dumps({"text": "x", "stream": "yes"}).encode()),
    ("/generate", json.dumps({"text": "x", "bootstrap_room": "r"}).encode()),
    ("/generate", json.dumps({"text": "x " * 20000}).encode()),  # longer than the context
    ("/v1/chat/completions", b"{not json"),
    ("/v1/chat/completions", json.dumps({"model": "m", "messages": "hi"}).encode()),
    ("/v1/chat/completions", json.dumps({"model": "m"}).encode()),
    ("/v1/chat/completions", json.dumps({"model": "m", "messages": [{"content": "x"}]}).encode()),
    ("/v1/chat/completions", json.dumps({**CHAT, "max_tokens": "x"}).encode()),
    ("/v1/chat/completions", json.dumps({**CHAT, "stream_options": 3}).encode()),
    ("/v1/completions", json.dumps({"model": "m", "prompt": "x", "max_tokens": "x"}).encode()),
    ("/v1/completions", json.dumps({"model": "m", "prompt": 7}).encode()),
    ("/v1/completions", json.dumps({"model": "m", "prompt": "x", "n": 2}).encode()),
    ("/abort_request", b"{bad"),
    ("/abort_request", json.dumps({"rid": 5}).encode()),
]


@pytest.mark.parametrize("path,raw", BAD)
def test_bad_input_gets_clear_4xx(emulator: EmulatorProcess, path: str, raw: bytes) -> None:
    status, text = request(emulator.url + path, "POST", raw=raw)
    assert 400 <= status < 500, text
    body = json.loads(text)
    message = body.get("message") or body.get("error")
    assert message, body
    assert emulator.alive()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/generate"])
def test_wrong_content_type_is_rejected(emulator: EmulatorProcess, path: str) -> None:
    status, text = request(emulator.url + path, "POST", raw=json.dumps(CHAT).encode(),
                           content_type="application/x-www-form-urlencoded")
    assert status == 400 and "application/json" in text


def test_real_bad_input_shapes_are_mirrored(emulator: EmulatorProcess, capture: dict[str, Any]) -> None:
    for name, path, raw in (("bad_generate_json", "/generate", b"{not json"),
                            ("bad_chat_type", "/v1/chat/completions", json.dumps({"model": "m", "messages": "hi"}).encode()),
                            ("bad_generate_empty", "/generate", b"{}")):
        status, text = request(emulator.url + path, "POST", raw=raw)
        assert status == capture[name]["status"]
        assert keys(json.loads(text)) == keys(capture[name]["json"])


def test_pd_pair_across_processes_with_transfer_delay(tmp_path) -> None:
    """The decode's first token comes the modelled transfer time after the prefill finished."""
    prefill = start_emulator(tmp_path, mode="prefill", profile="ascend-r1-prefill", time_scale=1)
    decode = start_emulator(tmp_path, mode="decode", profile="ascend-r1-decode", time_scale=1)
    try:
        body = {"input_ids": list(range(1000, 1000 + 50_000)), "sampling_params": {"max_new_tokens": 3},
                "bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port, "bootstrap_room": 77}
        out: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: out.update(d=request(decode.url + "/generate", "POST", body)))
        thread.start()  # decode first: it must wait for the prefill of room 77
        assert wait_until(lambda: decode.load()["disaggregation"]["decode_prealloc_queue_reqs"] == 1)
        status_p, text_p = request(prefill.url + "/generate", "POST", body)
        thread.join(timeout=30)
        status_d, text_d = out["d"]
        assert status_p == 200 and status_d == 200, (text_p, text_d)
        p, d = json.loads(text_p), json.loads(text_d)
        assert p["meta_info"]["completion_tokens"] == 1
        assert d["meta_info"]["completion_tokens"] == 3
        assert d["output_ids"][0] == p["output_ids"][0]
        transfer = load_profile("ascend-r1-prefill").cost_model().transfer_time(50_000)
        assert transfer == pytest.approx(0.002 + 50_000 * 70272 / 40e9)  # 90 ms
        # both clocks are this machine's wall clock
        gap = d["meta_info"]["prefill_finished_time"] - p["meta_info"]["request_finished_ts"]
        assert transfer - 0.005 <= gap <= transfer + 1.0, gap
        assert decode.load()["disaggregation"]["decode_prealloc_queue_reqs"] == 0
    finally:
        prefill.stop()
        decode.stop()


def _prefill_busy_us(emulator: EmulatorProcess) -> int:
    _, text = request(emulator.url + "/v1/loads", "GET")
    loads = json.loads(text)
    rows = loads.get("loads", [loads]) if isinstance(loads, dict) else loads
    return sum(int(r["total_prefill_busy_us"]) for r in rows)


def test_prefill_busy_time_is_reported_in_wall_time(emulator: EmulatorProcess) -> None:
    """With --time-scale the router sees busy time on its own clock, as from a real worker."""
    before = _prefill_busy_us(emulator)
    began = time.perf_counter()
    status, _ = request(emulator.url + "/generate", "POST",
                        {"input_ids": list(range(100, 2100)), "sampling_params": {"max_new_tokens": 1}})
    elapsed = time.perf_counter() - began
    assert status == 200
    busy = (_prefill_busy_us(emulator) - before) / 1e6
    assert 0 < busy <= elapsed


def test_every_route_alias_answers(emulator: EmulatorProcess) -> None:
    """SGLang's second names and methods of a route reach the same handler."""
    for path in ("/model_info", "/get_model_info", "/server_info", "/get_server_info"):
        assert request(emulator.url + path)[0] == 200, path
    assert request(emulator.url + "/get_model_info") == request(emulator.url + "/model_info")
    assert request(emulator.url + "/flush_cache", "GET")[0] == 200
    status, text = request(f"{emulator.url}/generate", "PUT", GEN)
    assert status == 200 and json.loads(text)["meta_info"]["completion_tokens"] == 4
