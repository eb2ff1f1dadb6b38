"""Helpers shared by the test modules (imported as `omni_testing`; conftest holds fixtures)."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def post_json(url: str, body: dict[str, Any], timeout: float = 120.0) -> Any:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def hf_greedy(model_dir: Path, input_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by Hugging Face transformers in float32 (the reference)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([input_ids])
    produced: list[int] = []
    past = None
    with torch.no_grad():
        for _ in range(max_new_tokens):  # plain argmax loop: no EOS handling, no logit processors
            out = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            token = int(out.logits[0, -1].argmax())
            produced.append(token)
            ids = torch.tensor([[token]])
    return produced


def post(url: str, body: Any, timeout: float = 30.0, raw: bytes | None = None
         ) -> tuple[int, Any, dict[str, str]]:
    data = raw if raw is not None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, _decode(response.read()), dict(response.headers)
    except urllib.error.HTTPError as err:
        return err.code, _decode(err.read()), dict(err.headers)


def get(url: str, timeout: float = 30.0) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, _decode(response.read())
    except urllib.error.HTTPError as err:
        return err.code, _decode(err.read())


def _decode(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return data.decode(errors="replace")


def sse_events(text: str) -> list[Any]:
    """The data payloads of an SSE body ([DONE] as the string)."""
    events = []
    for line in text.splitlines():
        if line.startswith("data:"):
            payload = line[5:].strip()
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def wait_until(predicate: Callable[[], Any], timeout: float = 10.0, step: float = 0.02) -> bool:
    """Poll ``predicate`` until it is truthy (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(step)


async def eventually(done: Callable[[], bool],
                     each: Callable[[], Awaitable[Any]] | None = None,
                     timeout: float = 10.0) -> bool:
    """Poll ``done`` every 20 ms until it holds or ``timeout`` passes; ``each`` runs first."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if each is not None:
            await each()
        await asyncio.sleep(0.02)
        if done():
            return True
    return False


# Processes that session- or package-scoped fixtures start and stop themselves: they outlive the
# module that first asks for them, so the leftover check below spares them and their children.
SESSION_PROCESSES: set[int] = set()
SPARED_COMMANDS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")
LEFTOVER_GRACE_S = 10.0


def leftovers(before: set[int]) -> list[Any]:
    """Descendants of this pytest process started since ``before`` that no session fixture owns."""
    import psutil

    me = psutil.Process()
    spared: set[int] = set()
    for pid in SESSION_PROCESSES:
        try:
            owner = psutil.Process(pid)
            spared |= {pid, *(c.pid for c in owner.children(recursive=True))}
        except psutil.NoSuchProcess:
            continue
    found = []
    for child in me.children(recursive=True):
        if child.pid in before or child.pid in spared:
            continue
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
            if any(name in " ".join(child.cmdline()) for name in SPARED_COMMANDS):
                continue
        except psutil.Error:
            continue
        found.append(child)
    return found
