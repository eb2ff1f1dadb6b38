"""What of a worker's info answers a client may read: secrets removed at any depth.

SGLang repeats its server arguments in ``/server_info`` (top level and again in each
``internal_states[i]``): ``api_key``, ``admin_api_key``, ``ssl_keyfile_password``, ... Every info
answer the router relays (``/server_info``, ``/get_server_info``, ``/model_info``,
``/get_model_info``, ``/v1/models``, ``/health_generate``) goes through :func:`redact` first.

Two views:

- ``strict`` (a user-role key, the ``--api-key`` holder, or any caller of an open route while
  keys exist): every object member whose name contains ``key``, ``secret``, ``password`` (and
  ``passwd``), ``token``, ``credential`` or ``auth`` (any case) is dropped, at any depth: a
  superset of what the full view drops. Harmless names go too (``max_total_num_tokens``,
  ``tokenizer_path``, ``author``): no such name reaches a user key at all. A string member
  named ``*_config``, ``*_extra_config`` or ``*_override_args`` that is not a JSON object or
  array is dropped too (an opaque setting may hold anything).
- full (an admin key, or any caller when no key is configured: who may read ``/list_workers``):
  names that may hold a secret are dropped (``key``, ``secret``, ``password``, ``passwd``,
  ``credential``, ``auth``, and ``token`` unless it reads ``tokens`` or ``tokenizer``), so the
  token counts and tokenizer settings stay visible.

In both views, strings are cleaned too: one that holds a JSON object or array (SGLang's
``hicache_storage_backend_extra_config``, ``model_loader_extra_config``,
``json_model_override_args``) is decoded, redacted as a nested value and written back
(compact) when anything was removed; in any other string, the user information of a URL
(``redis://user:pass@host`` and every ``scheme://...@``) becomes ``***``
(``redis://***@host``).

Nesting deeper than ``MAX_DEPTH`` is replaced by ``TOO_DEEP`` (orjson parses up to 1024 levels,
and writes only 255; a hostile worker must not break the answer or the stack).
"""

from __future__ import annotations

import re
from typing import Any

import orjson

MAX_DEPTH = 32
TOO_DEEP = "<redacted: too deeply nested>"
_STRICT = re.compile(r"key|secret|passw|token|credential|auth", re.IGNORECASE)
_SECRET = re.compile(r"key|secret|passw|credential|auth|token(?!s|izer)", re.IGNORECASE)
_OPAQUE = re.compile(r"_config$|_override_args$", re.IGNORECASE)  # strict: JSON or dropped
# a URL's scheme and user information: up to the last "@" before the authority ends
_USERINFO = re.compile(r"\b([a-z][a-z0-9+.-]*://)[^/?#\s]*@", re.IGNORECASE)
_UNDECODED = object()


def hidden(name: str, strict: bool) -> bool:
    """Whether an object member called ``name`` is removed from the given view (everything
    the full view removes, the strict view removes too)."""
    return (_STRICT if strict else _SECRET).search(name) is not None


def redact(value: Any, strict: bool = True, depth: int = 0) -> Any:
    """A copy of decoded JSON ``value`` without what the view hides, at any depth.

    Contract: dicts and lists are copied (the input is not changed); members whose name
    ``hidden`` says are dropped, and in the strict view opaque settings (see the module
    docstring); strings are cleaned by :func:`redact_text`; other scalars are returned as they
    are; a dict or list below ``MAX_DEPTH`` levels (a JSON string's content counts one level
    deeper than the string) becomes ``TOO_DEEP``. Recursion is bounded by ``MAX_DEPTH``
    whatever the input, and nothing raises on decoded JSON.
    """
    if isinstance(value, str):
        return redact_text(value, strict, depth)
    if isinstance(value, dict):
        if depth >= MAX_DEPTH:
            return TOO_DEEP
        pattern = _STRICT if strict else _SECRET
        out = {}
        for k, v in value.items():
            if isinstance(k, str) and pattern.search(k):
                continue
            if strict and isinstance(k, str) and isinstance(v, str) and _OPAQUE.search(k) \
                    and _json_container(v) is _UNDECODED:
                continue
            out[redact_text(k, strict, depth) if isinstance(k, str) else k] = \
                redact(v, strict, depth + 1)
        return out
    if isinstance(value, list):
        if depth >= MAX_DEPTH:
            return TOO_DEEP
        return [redact(v, strict, depth + 1) for v in value]
    return value


def redact_text(text: str, strict: bool = True, depth: int = 0) -> str:
    """``text`` as the view may read it: a JSON object or array in it is redacted and written
    back compact if anything was removed (else ``text`` is returned as it is); any other text
    has each URL's user information replaced by ``***``."""
    decoded = _json_container(text)
    if decoded is _UNDECODED:
        return _USERINFO.sub(r"\1***@", text) if "@" in text else text
    cleaned = redact(decoded, strict, depth + 1)
    return text if cleaned == decoded else orjson.dumps(cleaned).decode()


def _json_container(text: str) -> Any:
    """The object or array ``text`` holds as JSON, else ``_UNDECODED``."""
    head = text.lstrip()[:1]
    if head not in ("{", "["):
        return _UNDECODED
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return _UNDECODED
