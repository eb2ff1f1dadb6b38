"""Control-plane plumbing: worker answers read under a size cap, background loops supervised.

Every control answer a worker sends (health probes, ``/v1/loads`` polls, ``get_json``,
aborts, ``/flush_cache``, the relayed info routes) is read with :func:`read_capped`: at most
``cap`` bytes are kept (a declared larger ``Content-Length`` fails at once; a chunked body fails
as soon as it passes the cap), so an endless ``/v1/models`` costs a few chunks of memory, not the
process. The cap is ``control_cap(config)``: ``min(--max-response-size, CONTROL_ANSWER_CAP)``.

Every long-running loop runs under :func:`supervise`: an exception is logged with its
traceback, counted (``omniproxy_background_task_failures_total{task}``), and the loop starts
again after a backoff (doubling up to ``MAX_BACKOFF_S``, reset after a quiet minute).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import aiohttp

log = logging.getLogger("omniinfer.proxy")
CONTROL_ANSWER_CAP = 1 << 20  # /server_info of SGLang 0.5.23 is about 40 KB
CHUNK = 1 << 16
IDENTITY = {"Accept-Encoding": "identity"}  # bytes as sent: the cap counts what is kept
FIRST_BACKOFF_S = 0.1
MAX_BACKOFF_S = 5.0


class AnswerTooLarge(aiohttp.ClientPayloadError):
    """A worker's control answer passed the cap (a ClientError: callers treat it as a failure)."""


def control_cap(max_response_size: int) -> int:
    """The byte cap of one control answer, given ``--max-response-size``."""
    return max(1, min(max_response_size, CONTROL_ANSWER_CAP))


async def read_capped(resp: aiohttp.ClientResponse, cap: int) -> bytes:
    """The whole body of ``resp`` if it is at most ``cap`` bytes, else ``AnswerTooLarge``.

    Reads in chunks and stops at the first byte past the cap (the connection is closed, not
    drained); never holds more than ``cap`` plus one chunk."""
    if resp.content_length is not None and resp.content_length > cap:
        resp.close()
        raise AnswerTooLarge(f"answer of {resp.content_length} bytes; at most {cap} read")
    body = bytearray()
    while chunk := await resp.content.read(CHUNK):
        body += chunk
        if len(body) > cap:
            resp.close()
            raise AnswerTooLarge(f"answer larger than {cap} bytes")
    return bytes(body)


async def supervise(name: str, body: Callable[[], Awaitable[None]],
                    on_failure: Callable[[str], None]) -> None:
    """Run ``body`` for ever: restart it whenever it raises or returns, never die silently.

    Contract: cancellation ends the supervision (``close``); any other exception is logged
    with its traceback and reported through ``on_failure(name)``; a return is logged as a
    warning. Either way ``body`` runs again after a backoff."""
    backoff = FIRST_BACKOFF_S
    while True:
        started = time.monotonic()
        try:
            await body()
            log.warning("background task %s returned; restarting it", name)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - logged with the trace, counted, restarted
            log.exception("background task %s failed; restarting it in %.1f s", name, backoff)
            on_failure(name)
        if time.monotonic() - started > 60.0:
            backoff = FIRST_BACKOFF_S
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, MAX_BACKOFF_S)
