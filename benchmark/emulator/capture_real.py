"""Capture the responses of a running real SGLang server on every endpoint the emulator serves.

The captures are the reference the emulator's response shapes are checked against
(``test/emulator/real_shapes.json``, key sets only; the values are this machine's).

    python benchmark/emulator/capture_real.py --base-url http://127.0.0.1:31000 --output capture.json
"""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any


def call(base: str, method: str, path: str, body: Any = None, raw: bytes | None = None,
         content_type: str = "application/json") -> dict[str, Any]:
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(base + path, data=data, method=method)
    if data is not None:
        request.add_header("Content-Type", content_type)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            status, headers, payload = response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        status, headers, payload = exc.code, dict(exc.headers), exc.read()
    text = payload.decode("utf-8", "replace")
    out: dict[str, Any] = {"status": status, "content_type": headers.get("content-type")}
    if text.startswith("data:"):
        out["events"] = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
    else:
        try:
            out["json"] = json.loads(text)
        except json.JSONDecodeError:
            out["text"] = text
    return out


def capture(base: str) -> dict[str, Any]:
    gen = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}
    chat = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    comp = {"model": "default", "prompt": "The capital of France is", "max_tokens": 4}
    cases: dict[str, tuple[str, str, Any]] = {
        "health": ("GET", "/health", None),
        "health_generate": ("GET", "/health_generate", None),
        "model_info": ("GET", "/model_info", None),
        "server_info": ("GET", "/server_info", None),
        "v1_loads": ("GET", "/v1/loads", None),
        "v1_models": ("GET", "/v1/models", None),
        "generate": ("POST", "/generate", gen),
        "generate_ids": ("POST", "/generate", {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 3}}),
        "generate_stream": ("POST", "/generate", {**gen, "stream": True}),
        "generate_batch": ("POST", "/generate", {**gen, "text": ["a b", "c d"]}),
        "completions": ("POST", "/v1/completions", comp),
        "completions_stream": ("POST", "/v1/completions", {**comp, "stream": True}),
        "chat": ("POST", "/v1/chat/completions", chat),
        "chat_stream": ("POST", "/v1/chat/completions", {**chat, "stream": True}),
        "chat_stream_usage": ("POST", "/v1/chat/completions",
                              {**chat, "stream": True, "stream_options": {"include_usage": True}}),
        "flush_cache": ("POST", "/flush_cache", None),
        "abort_request": ("POST", "/abort_request", {"rid": "nope"}),
        "bad_generate_type": ("POST", "/generate", {"text": "x", "sampling_params": {"max_new_tokens": "many"}}),
        "bad_generate_empty": ("POST", "/generate", {}),
        "bad_chat_type": ("POST", "/v1/chat/completions", {"model": "m", "messages": "hi"}),
        "bad_chat_missing": ("POST", "/v1/chat/completions", {"model": "m"}),
        "bad_completions_type": ("POST", "/v1/completions", {"model": "m", "prompt": "x", "max_tokens": "x"}),
    }
    out = {name: call(base, *case) for name, case in cases.items()}
    out["bad_generate_json"] = call(base, "POST", "/generate", raw=b"{not json")
    out["bad_chat_json"] = call(base, "POST", "/v1/chat/completions", raw=b"{not json")
    metrics = call(base, "GET", "/metrics").get("text", "")
    out["metrics_names"] = sorted({line.split("{")[0].split(" ")[0] for line in metrics.splitlines()
                                   if line.startswith("sglang:")})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:30000")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    result = capture(args.base_url.rstrip("/"))
    args.output.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
