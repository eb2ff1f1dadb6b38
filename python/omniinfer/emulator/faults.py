"""Fault switches of an emulated worker and the log of what it received (router tests, soaks).

Each switch is a ``--fault-*`` flag at start and a field of ``POST /emulator/faults`` at run time
(``GET`` reads them, ``DELETE`` turns every one off). They act on generation requests
(``/generate``, ``/v1/completions``, ``/v1/chat/completions``):

``fail_status``          answer with this HTTP status and an error body, without running (0: off)
``hang_after_tokens``    stop making progress after this many output tokens (0: accept and never
                         answer) until the request is aborted or its client leaves (-1: off)
``disconnect_after_tokens``  close the connection once this many tokens were produced (a stream
                         has sent them), without ending the response; the worker lives (-1: off)
``exit_after_tokens``    exit the whole process, as a crash, at that point (-1: off)
``first_byte_delay_s``   hold the response's first byte back this long; the work is not delayed
                         (a prefill worker's KV is ready for its decode worker on time)

``GET /emulator/requests`` returns the last ``--request-log-size`` generation requests as
received (path, rid, body, Authorization header) and every ``/abort_request`` (rid, abort_all).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any


class FaultError(ValueError):
    """A fault setting that is unknown or of the wrong type; the message names it."""


@dataclasses.dataclass
class Faults:
    fail_status: int = 0
    hang_after_tokens: int = -1
    disconnect_after_tokens: int = -1
    exit_after_tokens: int = -1
    first_byte_delay_s: float = 0.0

    def update(self, changes: Any) -> None:
        """Apply a JSON object of switches; nothing changes unless every one is valid."""
        if not isinstance(changes, dict):
            raise FaultError("the body must be a JSON object of fault switches")
        fields = {f.name: f for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - set(fields))
        if unknown:
            raise FaultError(f"unknown fault switch(es) {', '.join(unknown)}; known: "
                             f"{', '.join(fields)}")
        checked = {name: _check(name, value) for name, value in changes.items()}
        for name, value in checked.items():
            setattr(self, name, value)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def reached(self, switch: int, tokens: int) -> bool:
        """Whether a ``*_after_tokens`` switch fires for a request with ``tokens`` outputs."""
        return 0 <= switch <= tokens


def _check(name: str, value: Any) -> int | float:
    if name == "first_byte_delay_s":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 3600:
            raise FaultError(f"{name} must be a number of seconds in [0, 3600], got {value!r}")
        return float(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise FaultError(f"{name} must be an integer, got {value!r}")
    if name == "fail_status":
        if value != 0 and not 400 <= value <= 599:
            raise FaultError(f"fail_status must be 0 (off) or an HTTP error status 400-599, got {value}")
    elif value < -1:
        raise FaultError(f"{name} must be -1 (off) or a token count >= 0, got {value}")
    return value


class RequestLog:
    """The last ``size`` generation requests and every abort, as the worker received them."""

    def __init__(self, size: int = 256) -> None:
        self.requests: collections.deque[dict[str, Any]] = collections.deque(maxlen=max(size, 0))
        self.aborts: collections.deque[dict[str, Any]] = collections.deque(maxlen=max(size, 0))

    def request(self, path: str, body: Any, authorization: str | None) -> None:
        rid = body.get("rid") if isinstance(body, dict) else None
        self.requests.append({"path": path, "rid": rid, "body": body,
                              "authorization": authorization, "ts": time.time()})

    def abort(self, rid: str, abort_all: bool) -> None:
        self.aborts.append({"rid": rid, "abort_all": abort_all, "ts": time.time()})

    def as_dict(self) -> dict[str, Any]:
        return {"requests": list(self.requests), "aborts": list(self.aborts)}
