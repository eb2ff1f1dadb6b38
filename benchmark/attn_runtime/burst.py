"""One real SGLang CPU server, one burst of requests sent at once: what both OmniAttn runtime
benchmarks (admission.py, prefix.py) measure, so they measure it the same way."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from omniinfer.child_process import free_port
from omniinfer.cpu.server_env import cpu_env
from omniinfer.testbed.servers import SGLangServer, cpu_server_command

SAMPLE_S = 0.5  # how often /v1/loads is read while the burst runs
PATTERN_FLAG = "--omni-attn-pattern"


def _get(url: str, timeout: float = 10.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return json.loads(reply.read())


def _post(url: str, body: dict[str, Any], timeout: float = 3600.0) -> Any:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        return json.loads(reply.read())


def running(base_url: str) -> int:
    """Requests running over every DP rank now; 0 when the server does not answer."""
    try:
        loads = _get(f"{base_url}/v1/loads")
    except OSError:
        return 0
    rows = loads.get("loads", [loads]) if isinstance(loads, dict) else loads
    return sum(int(r.get("num_running_reqs", 0)) for r in rows if isinstance(r, dict))


def burst(base_url: str, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """Send every prompt at once (greedy, ``new_tokens`` each), sample the running count until
    all are answered; totals over the replies. A failed request fails the burst."""
    replies: list[Any] = [None] * len(prompts)
    errors: list[Exception] = []
    done = threading.Event()
    left = [len(prompts)]
    lock = threading.Lock()

    def one(i: int) -> None:
        try:
            replies[i] = _post(f"{base_url}/generate", {
                "input_ids": prompts[i],
                "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0.0,
                                    "ignore_eos": True},
            })
        except Exception as exc:  # reported once the burst is over
            errors.append(exc)
        finally:
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    done.set()

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(prompts))]
    began = time.perf_counter()
    for t in threads:
        t.start()
    samples: list[int] = []
    while not done.is_set():
        samples.append(running(base_url))
        done.wait(SAMPLE_S)
    seconds = time.perf_counter() - began
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(prompts)} requests failed") from errors[0]
    meta = [r["meta_info"] for r in replies]
    output = sum(m["completion_tokens"] for m in meta)
    prompt = sum(m["prompt_tokens"] for m in meta)
    cached = sum(m.get("cached_tokens", 0) for m in meta)
    return {"peak_running": max(samples, default=0), "seconds": seconds,
            "output_tokens": output, "output_tokens_per_s": output / seconds,
            "prompt_tokens": prompt, "cached_tokens": cached,
            "cache_hit_rate": cached / max(1, prompt), "running_samples": samples}


def serve_burst(model: Path, max_total_tokens: int, chunked_prefill_size: int,
                extra: list[str], log: Path, prompts: list[list[int]], new_tokens: int
                ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Start a server with ``extra`` flags, run one burst on it, stop it. Returns the burst's
    result and, for a patterned server, its ``/omni/attn`` status (else None)."""
    port = free_port()
    extra = ["--chunked-prefill-size", str(chunked_prefill_size), *extra]
    command = cpu_server_command(model, port, max_total_tokens, extra_args=extra)
    with SGLangServer(command, cpu_env(), log, port, ready_timeout_s=900) as server:
        result = burst(server.base_url, prompts, new_tokens)
        status = _get(f"{server.base_url}/omni/attn") if PATTERN_FLAG in extra else None
    return result, status
