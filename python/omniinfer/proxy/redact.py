"""What of a worker's info answers a client may read: secrets removed at any depth.

SGLang repeats its server arguments in ``/server_info`` (top level and again in each
``internal_states[i]``): ``api_key``, ``admin_api_key``, ``ssl_keyfile_password``, ... Every info
answer the router relays (``/server_info``, ``/get_server_info``, ``/model_info``,
``/get_model_info``, ``/v1/models``, ``/health_generate``) goes through :func:`redact` first.

Two views:

- ``strict`` (a user-role key, the ``--api-key`` holder, or any caller of an open route while
  keys exist): every object member whose name contains ``key``, ``secret``, ``password`` (and
  ``passwd``), ``token`` or ``credential`` (any case) is dropped, at any depth. Harmless names
  go too (``max_total_num_tokens``, ``tokenizer_path``, ``skip_tokenizer_init``): no such name
  reaches a user key at all.
- full (an admin key, or any caller when no key is configured: who may read ``/list_workers``):
  names that may hold a secret are dropped (``key``, ``secret``, ``password``, ``passwd``,
  ``credential``, ``auth``, and ``token`` unless it reads ``tokens`` or ``tokenizer``), so the
  token counts and tokenizer settings stay visible.

Nesting deeper than ``MAX_DEPTH`` is replaced by ``TOO_DEEP`` (orjson parses up to 1024 levels,
and writes only 255; a hostile worker must not break the answer or the stack).
"""

from __future__ import annotations

import re
from typing import Any

MAX_DEPTH = 32
TOO_DEEP = "<redacted: too deeply nested>"
_STRICT = re.compile(r"key|secret|passw|token|credential", re.IGNORECASE)
_SECRET = re.compile(r"key|secret|passw|credential|auth|token(?!s|izer)", re.IGNORECASE)


def hidden(name: str, strict: bool) -> bool:
    """Whether an object member called ``name`` is removed from the given view."""
    return (_STRICT if strict else _SECRET).search(name) is not None


def redact(value: Any, strict: bool = True, depth: int = 0) -> Any:
    """A copy of decoded JSON ``value`` without the members the view hides, at any depth.

    Contract: dicts and lists are copied (the input is not changed), scalars returned as they
    are; members whose name ``hidden`` says are dropped; a dict or list below ``MAX_DEPTH``
    levels becomes ``TOO_DEEP``. Recursion is bounded by ``MAX_DEPTH`` whatever the input.
    """
    if isinstance(value, dict):
        if depth >= MAX_DEPTH:
            return TOO_DEEP
        pattern = _STRICT if strict else _SECRET
        return {k: redact(v, strict, depth + 1) for k, v in value.items()
                if not (isinstance(k, str) and pattern.search(k))}
    if isinstance(value, list):
        if depth >= MAX_DEPTH:
            return TOO_DEEP
        return [redact(v, strict, depth + 1) for v in value]
    return value
