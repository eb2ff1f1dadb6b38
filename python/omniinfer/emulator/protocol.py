"""Request parsing and response bodies in the shapes SGLang 0.5.23 uses.

Shapes were taken from real responses of ``sglang.launch_server`` 0.5.23 (captured by
``benchmark/emulator/capture_real.py``; the capture is ``test/emulator/sglang_0.5.23_capture.json``)
and from ``sglang/srt/entrypoints/http_server.py`` and ``openai/serving_{chat,completions}.py``.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

from omniinfer.emulator.request import EmuRequest
from omniinfer.emulator.tokenizer import EmulatedTokenizer

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's SamplingParams default


class BadRequest(ValueError):
    """A client error; ``body`` is the JSON error body SGLang sends for it."""

    def __init__(self, message: str, body: dict[str, Any] | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.status = status
        self.body = body if body is not None else {"error": {"message": message}}


def validation_error(message: str) -> BadRequest:
    """The ErrorResponse shape of SGLang's RequestValidationError handler (OpenAI routes, bad JSON)."""
    return BadRequest(
        message,
        {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400},
    )


def _typed(body: dict[str, Any], key: str, kinds: tuple[type, ...], default: Any, where: str) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds:
        raise BadRequest(f"invalid type: boolean for {where}{key}, expected {kinds[0].__name__}")
    if not isinstance(value, kinds):
        raise BadRequest(
            f"invalid type: {type(value).__name__} {value!r:.40} for {where}{key}, "
            f"expected {'/'.join(k.__name__ for k in kinds)}"
        )
    return value


def _int_list(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise BadRequest(f"{what} must be a list of integers")
    return value


@dataclasses.dataclass
class ParsedGenerate:
    prompts: list[list[int]]  # one per batch item
    batched: bool
    max_new_tokens: int
    stream: bool
    rid: list[str] | None
    bootstrap_host: str | None
    bootstrap_port: int | None
    bootstrap_room: int | None


def parse_sampling(params: Any, default_max: int | None = DEFAULT_MAX_NEW_TOKENS) -> int:
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise BadRequest("invalid type: sampling_params must be an object")
    for key in ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
                "repetition_penalty"):
        _typed(params, key, (int, float), None, "sampling_params.")
    _typed(params, "ignore_eos", (bool,), False, "sampling_params.")
    _typed(params, "min_new_tokens", (int,), 0, "sampling_params.")
    max_new = _typed(params, "max_new_tokens", (int,), default_max, "sampling_params.")
    if max_new is not None and max_new < 0:
        raise BadRequest("max_new_tokens must be at least 0")
    return max_new if max_new is not None else DEFAULT_MAX_NEW_TOKENS


def parse_generate(body: Any, tokenizer: EmulatedTokenizer) -> ParsedGenerate:
    if not isinstance(body, dict):
        raise validation_error("Input should be a valid dictionary or object to extract fields from")
    text, input_ids = body.get("text"), body.get("input_ids")
    if text is None and input_ids is None:
        raise BadRequest("Either text, input_ids or input_embeds should be provided.")
    if text is not None:
        if isinstance(text, str):
            prompts, batched = [tokenizer.encode(text)], False
        elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            prompts, batched = [tokenizer.encode(t) for t in text], True
        else:
            raise BadRequest("invalid type: text must be a string or a list of strings")
    else:
        if isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], list):
            prompts, batched = [_int_list(p, "input_ids") for p in input_ids], True
        else:
            prompts, batched = [_int_list(input_ids, "input_ids")], False
    if any(not p for p in prompts):
        raise BadRequest("The prompt is empty.")
    max_new = parse_sampling(body.get("sampling_params"))
    stream = _typed(body, "stream", (bool,), False, "")
    rid = body.get("rid")
    if rid is not None:
        rid = [rid] if isinstance(rid, str) else rid
        if not isinstance(rid, list) or not all(isinstance(r, str) for r in rid) or len(rid) != len(prompts):
            raise BadRequest("invalid type: rid must be a string (or one string per prompt)")
    room = _typed(body, "bootstrap_room", (int,), None, "")
    if batched and (room is not None or stream):
        raise BadRequest("the emulator serves batched prompts only without streaming and PD")
    return ParsedGenerate(
        prompts=prompts,
        batched=batched,
        max_new_tokens=max_new,
        stream=stream,
        rid=rid,
        bootstrap_host=_typed(body, "bootstrap_host", (str,), None, ""),
        bootstrap_port=_typed(body, "bootstrap_port", (int,), None, ""),
        bootstrap_room=room,
    )


def parse_openai(body: Any, chat: bool, tokenizer: EmulatedTokenizer, system_prompt: str = "") -> tuple[list[int], int, bool, bool, ParsedGenerate]:
    """Returns (prompt ids, max tokens, stream, include_usage, PD fields) of an OpenAI request."""
    if not isinstance(body, dict):
        raise validation_error("Input should be a valid dictionary or object to extract fields from")
    if chat:
        messages = body.get("messages")
        if messages is None:
            raise validation_error("1 validation error: messages: Field required")
        if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages
        ):
            raise validation_error("1 validation error: messages: Input should be a valid list of messages with a role")
        ids = tokenizer.encode(tokenizer.apply_chat_template(messages, system_prompt))
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, str) and prompt:
            ids = tokenizer.encode(prompt)
        elif isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str) and prompt[0]:
            ids = tokenizer.encode(prompt[0])
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise validation_error("1 validation error: prompt: Input should be a non-empty string, "
                                   "a one-string list or a list of token ids")
        max_tokens = body.get("max_tokens", 16)  # CompletionRequest default
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0):
        raise validation_error(f"1 validation error: max_tokens: Input should be a valid non-negative integer, got {max_tokens!r:.40}")
    n = body.get("n", 1)
    if n != 1:
        raise validation_error("the emulator serves n=1 only")
    for key in ("temperature", "top_p"):
        value = body.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise validation_error(f"1 validation error: {key}: Input should be a valid number")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise validation_error("1 validation error: stream: Input should be a valid boolean")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise validation_error("1 validation error: stream_options: Input should be an object")
    include_usage = bool(options.get("include_usage", False))
    room = body.get("bootstrap_room")
    port = body.get("bootstrap_port")
    host = body.get("bootstrap_host")
    if room is not None and (isinstance(room, bool) or not isinstance(room, int)):
        raise validation_error("1 validation error: bootstrap_room: Input should be a valid integer")
    if port is not None and (isinstance(port, bool) or not isinstance(port, int)):
        raise validation_error("1 validation error: bootstrap_port: Input should be a valid integer")
    if host is not None and not isinstance(host, str):
        raise validation_error("1 validation error: bootstrap_host: Input should be a valid string")
    pd = ParsedGenerate([ids], False, max_tokens or 0, stream, None, host, port, room)
    return ids, (DEFAULT_MAX_NEW_TOKENS if max_tokens is None else max_tokens), stream, include_usage, pd


# -- /generate bodies ---------------------------------------------------------------------------
def generate_meta(request: EmuRequest, final: bool, dispatch_ts: float, first_chunk: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": request.rid,
        "finish_reason": request.finish_reason if final else None,
        "prompt_tokens": request.prompt_tokens,
        "weight_version": "default",
        "num_retractions": request.num_retractions,
        "storage_prefetch_wait": 0.0,
        "storage_staging_wait": 0.0,
        "forward_entry_time": request.forward_entry_ts,
        "prefill_finished_time": request.first_token_ts,
        "queue_time": (request.forward_entry_ts - request.received_ts) if request.forward_entry_ts else 0.0,
        "reasoning_tokens": 0,
        "completion_tokens": len(request.output_ids),
        "cached_tokens": request.cached_tokens,
    }
    if final:
        meta["weight_versions"] = [{"version": "default", "start": 0, "end": len(request.output_ids)}]
    meta["cached_tokens_details"] = (
        {"device": request.cached_tokens, "host": 0} if request.cached_tokens else None
    )
    meta["dp_rank"] = None
    if final:
        finished = request.finished_ts or time.time()
        e2e = finished - request.received_ts
        first = (request.first_token_ts or finished) - request.received_ts
        decode_s = finished - (request.first_token_ts or finished)
        meta.update(
            e2e_latency=e2e,
            request_received_ts=request.received_ts,
            first_token_latency=first,
            api_server_dispatch_finish_ts=dispatch_ts,
            request_finished_ts=finished,
            decode_throughput=(len(request.output_ids) - 1) / decode_s if decode_s > 0 else 0.0,
        )
    if final or first_chunk:
        meta["response_sent_to_client_ts"] = time.time()
    if request.error:
        meta["finish_reason"] = {"type": "abort", "message": request.error, "status_code": 503}
    return meta


def generate_body(request: EmuRequest, tokenizer: EmulatedTokenizer, final: bool, dispatch_ts: float,
                  upto: int | None = None, start: int = 0) -> dict[str, Any]:
    ids = request.output_ids[start:upto]
    return {
        "text": tokenizer.decode(ids),
        "output_ids": ids,
        "meta_info": generate_meta(request, final, dispatch_ts, first_chunk=start == 0 and len(ids) == 1),
    }


# -- OpenAI bodies ------------------------------------------------------------------------------
def new_id() -> str:
    return uuid.uuid4().hex


def usage(request: EmuRequest) -> dict[str, Any]:
    completion = len(request.output_ids)
    return {
        "prompt_tokens": request.prompt_tokens,
        "total_tokens": request.prompt_tokens + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": request.cached_tokens} if request.cached_tokens else None,
        "reasoning_tokens": 0,
        "completion_tokens_details": None,
    }


def finish_reason_name(request: EmuRequest) -> str | None:
    if request.finish_reason is None:
        return None
    return "abort" if request.finish_reason.get("type") == "abort" else str(request.finish_reason.get("type"))


def metadata(request: EmuRequest) -> dict[str, Any]:
    return {"weight_version": "default",
            "weight_versions": [{"version": "default", "start": 0, "end": len(request.output_ids)}]}


def completion_body(request: EmuRequest, text: str, model: str, rid: str, created: int) -> dict[str, Any]:
    return {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None,
                     "finish_reason": finish_reason_name(request), "matched_stop": None}],
        "usage": usage(request), "metadata": metadata(request),
    }


def completion_chunk(text: str, finish: str | None, model: str, rid: str, created: int) -> dict[str, Any]:
    return {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                     "matched_stop": None}],
        "usage": None,
    }


def chat_body(request: EmuRequest, text: str, model: str, rid: str, created: int) -> dict[str, Any]:
    return {
        "id": rid, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": 0,
                     "message": {"role": "assistant", "content": text, "reasoning_content": None},
                     "logprobs": None, "finish_reason": finish_reason_name(request), "matched_stop": None}],
        "usage": usage(request), "metadata": metadata(request),
    }


def chat_chunk(delta: dict[str, Any], finish: str | None, model: str, rid: str, created: int) -> dict[str, Any]:
    return {
        "id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish,
                     "matched_stop": None}],
    }


def usage_chunk(request: EmuRequest, obj: str, model: str, rid: str, created: int) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(request)}
