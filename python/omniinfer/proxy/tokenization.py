"""Turn a request body into the prompt's token ids, the way the served model's worker will.

With ``--tokenizer-path``/``--model-path`` the router loads the model's own tokenizer
(transformers ``AutoTokenizer``; chat requests go through its chat template), so prefix blocks
hash the same tokens the worker's radix cache holds. Without one, ``ApproxTokenizer`` stands in:
4 UTF-8 bytes per pseudo-token — counts are estimates, prefix matching still works on the text.
"""

from __future__ import annotations

import abc
import struct
from typing import Any

import orjson

DEFAULT_OUTPUT_TOKENS = 128


class BadRequest(ValueError):
    """The body cannot be routed; the message goes back to the client with status 400."""


class Tokenizer(abc.ABC):
    name: str = "base"

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of a plain prompt, special tokens as the worker adds them."""

    @abc.abstractmethod
    def encode_chat(self, messages: list[Any], body: dict[str, Any]) -> list[int]:
        """Token ids of a chat prompt after the chat template (with the generation prompt)."""


class ApproxTokenizer(Tokenizer):
    """No tokenizer configured: fixed 4-byte chunks of UTF-8 as pseudo-tokens."""

    name = "approx"

    def encode(self, text: str) -> list[int]:
        data = text.encode("utf-8", "surrogatepass")
        if len(data) % 4:  # the last chunk, zero-padded, reads as it would alone
            data += bytes(4 - len(data) % 4)
        return list(struct.unpack(f"<{len(data) // 4}I", data))  # one C call, not one per chunk

    def encode_chat(self, messages: list[Any], body: dict[str, Any]) -> list[int]:
        parts = []
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else message
            parts.append(f"<{message.get('role', '') if isinstance(message, dict) else ''}>")
            parts.append(content if isinstance(content, str) else repr(content))
        return self.encode("\n".join(parts))


class HFTokenizer(Tokenizer):
    """The served model's tokenizer; uses the Rust fast tokenizer directly for plain text."""

    name = "hf"

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self.path = path
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self._fast = getattr(self.tokenizer, "backend_tokenizer", None) or getattr(
            self.tokenizer, "_tokenizer", None)

    def encode(self, text: str) -> list[int]:
        if self._fast is not None:
            return list(self._fast.encode(text, add_special_tokens=True).ids)
        return list(self.tokenizer.encode(text))

    def encode_chat(self, messages: list[Any], body: dict[str, Any]) -> list[int]:
        kwargs = body.get("chat_template_kwargs")
        extra = kwargs if isinstance(kwargs, dict) else {}
        tools = body.get("tools") if isinstance(body.get("tools"), list) else None
        try:
            ids = self.tokenizer.apply_chat_template(
                messages, tokenize=True, add_generation_prompt=True, tools=tools, **extra)
        except Exception as exc:  # a template error is the request's fault, not the router's
            raise BadRequest(f"chat template failed: {exc}") from exc
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]


def load_tokenizer(path: str | None) -> Tokenizer:
    return ApproxTokenizer() if not path else HFTokenizer(path)


def _token_list(value: Any, field: str) -> list[int]:
    if not isinstance(value, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise BadRequest(f"'{field}' must be a list of integers (or a list of such lists)")
    return value


def _text_or_ids(value: Any, field: str, tokenizer: Tokenizer) -> list[list[int]]:
    """One token list per prompt of a possibly batched text/ids field."""
    if isinstance(value, str):
        return [tokenizer.encode(value)]
    if isinstance(value, list):
        if not value:
            raise BadRequest(f"'{field}' must not be empty")
        if all(isinstance(v, str) for v in value):
            return [tokenizer.encode(v) for v in value]
        if all(isinstance(v, list) for v in value):
            return [_token_list(v, field) for v in value]
        return [_token_list(value, field)]
    raise BadRequest(f"'{field}' must be a string, a list of strings or a list of token ids")


def prompt_tokens(endpoint: str, body: dict[str, Any], tokenizer: Tokenizer) -> list[list[int]]:
    """Token ids per prompt in ``body`` for ``endpoint`` (generate / completions / chat)."""
    if endpoint == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list")
        if not all(isinstance(m, dict) for m in messages):
            raise BadRequest("each message must be an object")
        return [tokenizer.encode_chat(messages, body)]
    if endpoint == "completions":
        if "prompt" not in body:
            raise BadRequest("'prompt' is required")
        return _text_or_ids(body["prompt"], "prompt", tokenizer)
    if body.get("input_ids") is not None:
        return _text_or_ids(body["input_ids"], "input_ids", tokenizer)
    if body.get("text") is not None:
        return _text_or_ids(body["text"], "text", tokenizer)
    if body.get("input_embeds") is not None:
        return [[]]
    raise BadRequest("one of 'text' or 'input_ids' is required")


def parse_body(endpoint: str, raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object the router can forward, or BadRequest (the message
    names what is wrong)."""
    try:
        body = orjson.loads(raw)
        orjson.dumps(body)  # what cannot be re-encoded for the workers is refused now
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"body is not valid JSON: {exc}") from None
    except (TypeError, orjson.JSONEncodeError) as exc:
        raise BadRequest(f"body cannot be forwarded: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    if not isinstance(body.get("stream", False), bool):
        raise BadRequest("'stream' must be true or false")
    check_limits(endpoint, body)
    return body


def _limit(value: Any, field: str) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise BadRequest(f"'{field}' must be a non-negative integer")


def check_limits(endpoint: str, body: dict[str, Any]) -> None:
    """Refuse output limits no worker accepts, here: forwarded, they would be answered 5xx
    whenever no worker is available, an error the client's input caused."""
    if endpoint == "generate":
        params = body.get("sampling_params")
        if params is None:
            return
        for one in params if isinstance(params, list) else [params]:
            if not isinstance(one, dict):
                raise BadRequest("'sampling_params' must be an object (or a list of objects)")
            _limit(one.get("max_new_tokens"), "max_new_tokens")
        return
    for field in ("max_tokens", "max_completion_tokens"):
        _limit(body.get(field), field)


def output_budget(endpoint: str, body: dict[str, Any], default: int = DEFAULT_OUTPUT_TOKENS) -> int:
    """Expected output tokens (the request's limit, else ``default``) for load accounting."""
    if endpoint == "generate":
        params = body.get("sampling_params")
        value = params.get("max_new_tokens") if isinstance(params, dict) else None
    else:
        value = body.get("max_completion_tokens", body.get("max_tokens"))
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return default
