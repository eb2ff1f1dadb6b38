"""Helpers for the real-PD tests: prompts, requests to servers and routers, idle checks."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import omniinfer.data
from omni_testing import ROOT, sse_events
from omni_testing import post as http_post
from omniinfer.child_process import free_port
from omniinfer.proxy.process import RouterProcess
from omniinfer.testbed.pd_servers import wait_idle

# The shipped OmniAttn pattern for SmolLM2-135M, on every server of a patterned PD pair (the
# pair must agree on what a compressed layer sends), with the metrics the status reads.
PATTERN = ROOT / "python" / "omniinfer" / "attn" / "patterns" / "smollm2-135m.json"
PATTERN_FLAGS = ["--omni-attn-pattern", str(PATTERN), "--enable-metrics"]
TEXT = (Path(omniinfer.data.__file__).parent / "text" / "paradise_lost.txt").read_text()
START = TEXT.index("Of Mans First Disobedience") if "Of Mans First Disobedience" in TEXT else 0

PROMPTS: list[str] = [
    "The capital of France is",
    "List three colours of the rainbow:",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    # about 1,100 tokens of verse, then an instruction
    TEXT[START:START + 4800] + "\n\nIn one sentence, what is this passage about?",
]
MAX_NEW_TOKENS = 24


def gen_body(prompt: str | list[str], stream: bool = False, max_new_tokens: int = MAX_NEW_TOKENS,
             **extra: Any) -> dict[str, Any]:
    return {"text": prompt, "stream": stream,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens,
                                "ignore_eos": True}, **extra}


def post(url: str, body: dict[str, Any], timeout: float = 300.0) -> tuple[int, Any]:
    """(status, JSON or text); non-2xx answers are returned, not raised."""
    status, data, _headers = http_post(url, body, timeout)
    return status, data


def stream_text(url: str, body: dict[str, Any]) -> tuple[int, list[Any]]:
    status, raw = post(url, dict(body, stream=True))
    return status, sse_events(raw) if isinstance(raw, str) else [raw]


def assert_idle(url: str, timeout_s: float = 60.0) -> None:
    """The server ends up holding nothing for any request (running, queued, KV in use)."""
    reading = wait_idle(url, timeout_s)
    assert not any(reading.values()), f"{url} still holds {reading}"


# A live server here can take longer than the router's default 5 s to answer /health while the
# other lane's work has both cores (seen: a patterned prefill server ejected mid-test, every
# later request answered 503). Tests of ejection pass their own flags in ``extra``, which win.
PATIENT_HEALTH = ["--health-check-timeout-secs", "30"]


@contextmanager
def omniproxy(servers: Sequence[Any], policy: str, model: Path, log_dir: Path,
              extra: Sequence[str] = ()) -> Iterator[RouterProcess]:
    from omniinfer.testbed.pd_servers import router_args

    args = [*router_args(servers), "--prefill-policy", policy,
            "--decode-policy", "oas" if policy.startswith("oas") else "round_robin",
            "--model-path", str(model), *PATIENT_HEALTH, *extra]
    with RouterProcess(args, log_dir / f"omniproxy-{policy}-{free_port()}.log") as router:
        yield router


@contextmanager
def sglang_router(servers: Sequence[Any], log_dir: Path, policy: str = "round_robin"
                  ) -> Iterator[Any]:
    from omniinfer.testbed.pd_servers import sglang_router as peer

    with peer(servers, log_dir / f"sglang-router-{free_port()}.log", policy) as router:
        yield router


def run(command: Sequence[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(command), capture_output=True, text=True, timeout=timeout)
