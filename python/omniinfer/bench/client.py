"""Streaming clients for SGLang's native /generate and its OpenAI-compatible endpoints.

Each backend turns a BenchRequest into one HTTP request and reads the event stream, timing the
first token (TTFT) and every later chunk (ITL). Backends are a registry: adding one is one class.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from omniinfer.bench.workloads import BenchRequest

PromptText = Callable[[BenchRequest], str]


@dataclasses.dataclass
class RequestResult:
    """What one request measured; times in seconds, ``start``/``end`` relative to the run."""

    index: int
    prompt_tokens: int
    requested_output_tokens: int
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = dataclasses.field(default_factory=list)
    start: float = 0.0
    end: float = 0.0
    error: str | None = None
    status: int | None = None
    cached_tokens: int | None = None
    text: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def row(self) -> dict[str, object]:
        data = dataclasses.asdict(self)
        data["tpot"] = self.tpot
        return data


class Backend:
    """One HTTP API: the path, the request body and how to read one stream event."""

    path = ""

    def body(self, request: BenchRequest, prompt_text: PromptText) -> dict[str, Any]:
        raise NotImplementedError

    def read(self, event: dict[str, Any], result: RequestResult) -> int:
        """Update ``result`` from one event; return the number of new output tokens."""
        raise NotImplementedError


class SGLangNative(Backend):
    """POST /generate; events carry cumulative text and meta_info.completion_tokens."""

    path = "/generate"

    def body(self, request: BenchRequest, prompt_text: PromptText) -> dict[str, Any]:
        body: dict[str, Any] = {
            "sampling_params": {
                "max_new_tokens": request.output_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
            },
            "stream": True,
        }
        if request.input_ids is not None:
            body["input_ids"] = list(request.input_ids)
        else:
            body["text"] = prompt_text(request)
        return body

    def read(self, event: dict[str, Any], result: RequestResult) -> int:
        meta = event.get("meta_info", {})
        produced = int(meta.get("completion_tokens", result.output_tokens))
        if "cached_tokens" in meta:
            result.cached_tokens = int(meta["cached_tokens"])
        result.text = event.get("text", result.text)
        new = produced - result.output_tokens
        result.output_tokens = max(produced, result.output_tokens)
        return max(new, 0)


class OpenAICompletions(Backend):
    """POST /v1/completions; token ids are a valid `prompt` there."""

    path = "/v1/completions"

    def body(self, request: BenchRequest, prompt_text: PromptText) -> dict[str, Any]:
        prompt: Any = list(request.input_ids) if request.input_ids is not None else prompt_text(request)
        return {
            "model": "default",
            "prompt": prompt,
            "max_tokens": request.output_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    def _delta(self, choice: dict[str, Any]) -> str:
        return str(choice.get("text") or "")

    def read(self, event: dict[str, Any], result: RequestResult) -> int:
        usage = event.get("usage")
        if usage:
            result.output_tokens = int(usage.get("completion_tokens", result.output_tokens))
            details = usage.get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                result.cached_tokens = int(details["cached_tokens"])
        new = 0
        for choice in event.get("choices") or []:
            delta = self._delta(choice)
            if delta:
                result.text += delta
                new += 1
        if new and not usage:
            result.output_tokens += new
        return new


class OpenAIChat(OpenAICompletions):
    """POST /v1/chat/completions; the prompt goes as one user message of text."""

    path = "/v1/chat/completions"

    def body(self, request: BenchRequest, prompt_text: PromptText) -> dict[str, Any]:
        body = super().body(request, prompt_text)
        del body["prompt"]
        body["messages"] = [{"role": "user", "content": prompt_text(request)}]
        return body

    def _delta(self, choice: dict[str, Any]) -> str:
        return str((choice.get("delta") or {}).get("content") or "")


BACKENDS: dict[str, Backend] = {
    "sglang": SGLangNative(),
    "openai": OpenAICompletions(),
    "openai-chat": OpenAIChat(),
}


async def send(
    session: aiohttp.ClientSession,
    base_url: str,
    backend: Backend,
    request: BenchRequest,
    prompt_text: PromptText,
    t0: float,
) -> RequestResult:
    """Send one streaming request and time it; never raises for a server or network fault."""
    result = RequestResult(request.index, request.prompt_tokens, request.output_tokens)
    start = time.perf_counter()
    result.start = start - t0
    last = start
    try:
        async with session.post(base_url + backend.path, json=backend.body(request, prompt_text)) as resp:
            result.status = resp.status
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return result
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                event = json.loads(payload)
                if isinstance(event, dict) and event.get("error"):
                    result.error = str(event["error"])[:200]
                    return result
                now = time.perf_counter()
                if backend.read(event, result) > 0:
                    if result.ttft is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
        return result
    finally:
        result.end = time.perf_counter() - t0
    result.e2e = time.perf_counter() - start
    if result.output_tokens == 0:
        result.error = "no tokens received"
    return result
