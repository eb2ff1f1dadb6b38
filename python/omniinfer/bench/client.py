"""Streaming clients for SGLang's native /generate and its OpenAI-compatible endpoints."""

from __future__ import annotations

import dataclasses
import json
import time

import aiohttp

from omniinfer.bench.workloads import BenchRequest


@dataclasses.dataclass
class RequestResult:
    """What one request measured; times in seconds."""

    index: int
    prompt_tokens: int
    requested_output_tokens: int
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = dataclasses.field(default_factory=list)
    start: float = 0.0
    error: str | None = None
    status: int | None = None
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


async def stream_generate(
    session: aiohttp.ClientSession, base_url: str, request: BenchRequest, t0: float
) -> RequestResult:
    """POST /generate with stream=true; one SSE event per emitted chunk."""
    result = RequestResult(request.index, request.prompt_tokens, request.output_tokens)
    body = {
        "text": request.prompt,
        "sampling_params": {
            "max_new_tokens": request.output_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
        },
        "stream": True,
    }
    start = time.perf_counter()
    result.start = start - t0
    last = start
    try:
        async with session.post(f"{base_url}/generate", json=body) as response:
            result.status = response.status
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return result
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                event = json.loads(payload)
                if "error" in event:
                    result.error = str(event["error"])[:200]
                    return result
                now = time.perf_counter()
                produced = int(event.get("meta_info", {}).get("completion_tokens", result.output_tokens))
                if produced > result.output_tokens:
                    if result.ttft is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    result.output_tokens = produced
                result.text = event.get("text", result.text)
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
        return result
    result.e2e = time.perf_counter() - start
    if result.output_tokens == 0:
        result.error = "no tokens received"
    return result
