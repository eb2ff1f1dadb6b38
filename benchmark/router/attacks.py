"""Attacks the soak mixes into its traffic (``soak.py --attacks``), each with what must hold.

- ``large``: a legitimate request with a ~1 MiB body (the router's head timeout is short in the
  soak, so a body that arrives while the head deadline is wrongly armed gets cut): it must get
  its whole answer (a stream ends with ``[DONE]``).
- ``user_admin``: a data-plane user key calls every admin route: each must be refused (403).
- ``compressed``: a small gzip body that inflates to 8 MiB: it must be refused (415) without
  being inflated.
- ``no_read``: a client that posts a long stream and never reads it, for ``NO_READ_HOLD_S``:
  the router's write deadline must free its slot (the counters at the end show it).
"""

from __future__ import annotations

import asyncio
import gzip
import json
import random
import socket
from typing import Any

import aiohttp

USER_KEY = "soak-user"
ADMIN_KEY = "soak-admin"
NO_READ_HOLD_S = 10.0
WEIGHTS = {"large": 3, "user_admin": 2, "compressed": 2, "no_read": 1}
_BOMB = gzip.compress(b'{"text": "' + b" " * (8 << 20) + b'"}', 9)


def router_flags() -> list[str]:
    """What the router under attack runs with (on top of the soak's own flags)."""
    return ["--control-plane-api-keys", f"ops:ops:admin:{ADMIN_KEY}",
            f"u1:app:user:{USER_KEY}", "--client-header-timeout-secs", "2",
            "--client-write-timeout-secs", "3"]


async def attack(kind: str, session: aiohttp.ClientSession, base: str, data_key: str,
                 tally: Any) -> None:
    """Run one attack; a broken promise goes to ``tally.lost`` (legitimate work cut) or
    ``tally.breaches`` (an attack that got through)."""
    tally.add(f"sent_{kind}")
    try:
        await {"large": _large, "user_admin": _user_admin, "compressed": _compressed,
               "no_read": _no_read}[kind](session, base, data_key, tally)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        if kind == "large":
            tally.lost.append(f"large: {exc.__class__.__name__}: {exc}")
        else:
            tally.add(f"{kind}_closed")  # the router closing an attacker's connection is fine


async def _large(session: aiohttp.ClientSession, base: str, key: str, tally: Any) -> None:
    stream = random.random() < 0.5
    data = (b'{"text": "large body",' + b" " * (1 << 20) + b'"stream": ' +
            (b"true" if stream else b"false") + b', "sampling_params": {"max_new_tokens": 16}}')
    async with session.post(base + "/generate", data=data,
                            headers={"Authorization": f"Bearer {key}",
                                     "Content-Type": "application/json"},
                            timeout=aiohttp.ClientTimeout(total=180)) as resp:
        tally.add(f"large_status_{resp.status}")
        text = (await resp.read()).decode(errors="replace")
        if resp.status != 200 and resp.status < 500:
            tally.lost.append(f"large: {resp.status} {text[:120]!r}")
        elif resp.status == 200 and stream and not text.rstrip().endswith("[DONE]"):
            tally.lost.append(f"large stream without its end: {text[-120:]!r}")


async def _user_admin(session: aiohttp.ClientSession, base: str, key: str, tally: Any) -> None:
    headers = {"Authorization": f"Bearer {USER_KEY}"}
    for path, body in (("/add_worker", {"url": "http://127.0.0.1:9", "worker_type": "decode"}),
                       ("/remove_worker", {"url": "http://127.0.0.1:9"}),
                       ("/flush_cache", None), ("/list_workers", None)):
        method = "GET" if path == "/list_workers" else "POST"
        async with session.request(method, base + path, json=body, headers=headers,
                                   timeout=aiohttp.ClientTimeout(total=30)) as resp:
            await resp.read()
            if resp.status != 403:
                tally.breaches.append(f"user key on {path}: {resp.status}")


async def _compressed(session: aiohttp.ClientSession, base: str, key: str, tally: Any) -> None:
    async with session.post(base + "/generate", data=_BOMB,
                            headers={"Authorization": f"Bearer {key}",
                                     "Content-Type": "application/json",
                                     "Content-Encoding": "gzip"},
                            timeout=aiohttp.ClientTimeout(total=30)) as resp:
        await resp.read()
        tally.add(f"compressed_status_{resp.status}")
        if resp.status != 415:
            tally.breaches.append(f"compressed body answered {resp.status}")


async def _no_read(session: aiohttp.ClientSession, base: str, key: str, tally: Any) -> None:
    host, port = base.rsplit("/", 1)[1].rsplit(":", 1)
    body = json.dumps({"text": "never read " * 20, "stream": True,
                       "sampling_params": {"max_new_tokens": 3000}}).encode()
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await loop.sock_connect(sock, (host, int(port)))
        await loop.sock_sendall(sock, b"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: "
                                b"Bearer " + key.encode() + b"\r\nContent-Type: "
                                b"application/json\r\nContent-Length: " +
                                str(len(body)).encode() + b"\r\n\r\n" + body)
        await asyncio.sleep(NO_READ_HOLD_S)  # and never read a byte
    finally:
        sock.close()
