"""What the patterned real-server tests share: the server, its routes, the evaluator's greedy.

Each test module starts its own server (its flags are what it pins), through
:func:`patterned_server`; outputs are compared with :func:`masked_greedy` (re-exported from
``omniinfer.attn.decode``), the evaluator's masked model decoding greedily over a cache that
keeps every token.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from omni_testing import post_json
from omniinfer.attn import masks, text
from omniinfer.attn.decode import masked_greedy as masked_greedy  # the tests' reference
from omniinfer.attn.pattern import Pattern, from_layers
from omniinfer.child_process import free_port
from omniinfer.cpu.server_env import cpu_env
from omniinfer.testbed.servers import SGLangServer, cpu_server_command

SINK, RECENT = 16, 64  # the SmolLM2 servers' pattern (conftest's ``pattern``)


@contextmanager
def patterned_server(model: Path, pattern_path: Path, max_total_tokens: int,
                     extra_args: Sequence[str], log: Path,
                     env: dict[str, str] | None = None) -> Iterator[SGLangServer]:
    """A real CPU server with ``--omni-attn-pattern pattern_path`` and ``extra_args``."""
    port = free_port()
    command = cpu_server_command(
        model, port, max_total_tokens=max_total_tokens,
        extra_args=["--omni-attn-pattern", str(pattern_path), *extra_args])
    with SGLangServer(command, env or cpu_env(), log, port, ready_timeout_s=600) as running:
        yield running


def saved_pattern(model: Path, layers: Sequence[int], sink: int, recent: int,
                  folder: Path) -> tuple[Pattern, Path]:
    """A pattern compressing ``layers`` of ``model``, and the file it is saved to in ``folder``."""
    from transformers import AutoConfig

    made = from_layers(layers, AutoConfig.from_pretrained(model), sink, recent, str(model))
    path = folder / "pattern.json"
    made.save(path)
    return made, path


def windows(pattern: Pattern) -> masks.Windows:
    """The evaluator's per-layer windows for a pattern."""
    return masks.windows_for(pattern.mask, pattern.sink, pattern.recent)


def generate(base_url: str, prompt: list[int], new: int, timeout: float = 1800) -> dict[str, Any]:
    """One greedy ``/generate`` of ``new`` tokens that ignores EOS."""
    return post_json(f"{base_url}/generate", {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True},
    }, timeout=timeout)


def attn_status(base_url: str) -> dict[str, Any]:
    """The server's ``/omni/attn`` status."""
    with urllib.request.urlopen(f"{base_url}/omni/attn", timeout=30) as reply:
        return json.loads(reply.read())


def wait_status(base_url: str, settled: Callable[[dict[str, Any]], bool],
                timeout_s: float = 60.0) -> dict[str, Any]:
    """Poll ``/omni/attn`` until ``settled(status)`` or the deadline; the last status read."""
    deadline = time.monotonic() + timeout_s
    status = attn_status(base_url)
    while not settled(status) and time.monotonic() < deadline:
        time.sleep(0.5)
        status = attn_status(base_url)
    return status


def pools_balanced(status: dict[str, Any]) -> bool:
    """Whether both pools of the ``/omni/attn`` radix ledger add up: free + evictable +
    protected = capacity (true once no request holds slots outside the tree)."""
    book = status["radix"]["ledger"]
    return all(p["free"] + p["evictable"] + p["protected"] == p["capacity"] for p in book.values())


def book_tokens(model: Path, start: int, end: int) -> list[int]:
    """Token ids of characters ``start:end`` of the packaged book text."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model).encode(text.read("paradise_lost")[start:end])
