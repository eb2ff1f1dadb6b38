"""Load generators: the closed loop (fixed concurrency) and open-loop trace replay."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import aiohttp
from tqdm import tqdm

from omniinfer.bench.client import BACKENDS, Backend, PromptText, RequestResult, send
from omniinfer.bench.workloads import BenchRequest


class TargetUnreachable(RuntimeError):
    """The server did not answer at all; one message instead of a stack of timeouts."""


def open_session(timeout_s: float) -> aiohttp.ClientSession:
    """A client session with no cap on connections in flight.

    aiohttp's default connector holds at most 100 connections; request 101 would wait in the
    client for one while its clock runs, invisible to the server. An open loop must put every
    request on the wire at its arrival time, and a closed loop's cap is its concurrency, so the
    connector sets none of its own.
    """
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s),
                                 connector=aiohttp.TCPConnector(limit=0))


def _no_text(request: BenchRequest) -> str:
    if request.prompt is None:
        raise ValueError("this backend needs prompt text: pass a tokenizer")
    return request.prompt


class Turns:
    """Which requests are answered, for turns that wait for an earlier one (``after``)."""

    def __init__(self, requests: Sequence[BenchRequest], think_scale: float = 1.0) -> None:
        position = {r.index: i for i, r in enumerate(requests)}
        self.answered: dict[int, asyncio.Event] = {}
        for i, r in enumerate(requests):
            if r.after is None:
                continue
            if position.get(r.after, i) >= i:  # later or missing: a closed loop could deadlock
                raise ValueError(f"request {r.index} follows {r.after}, which does not come "
                                 "before it in the workload")
            self.answered.setdefault(r.after, asyncio.Event())
        self.think_scale = think_scale

    async def ready(self, request: BenchRequest) -> None:
        """Return once the request this one follows is answered and the think time has passed."""
        if request.after is None:
            return
        await self.answered[request.after].wait()
        if request.think_s > 0:
            await asyncio.sleep(request.think_s * self.think_scale)  # the user's think time

    def answer(self, request: BenchRequest) -> None:
        event = self.answered.get(request.index)
        if event is not None:
            event.set()


async def check_reachable(base_url: str, timeout_s: float = 10.0) -> None:
    """GET /health (falling back to /v1/models); raise TargetUnreachable if nothing answers."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        last_error = ""
        for path in ("/health", "/v1/models"):
            try:
                async with session.get(base_url + path) as response:
                    if response.status < 500:
                        return
                    last_error = f"HTTP {response.status} from {path}"
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                last_error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    raise TargetUnreachable(f"cannot reach {base_url}: {last_error}")


async def run_closed_loop(
    base_url: str,
    requests: Sequence[BenchRequest],
    concurrency: int,
    backend: Backend | str = "sglang",
    prompt_text: PromptText = _no_text,
    duration_s: float | None = None,
    timeout_s: float = 3600.0,
    progress: bool = True,
) -> tuple[list[RequestResult], float]:
    """Keep ``concurrency`` requests in flight: when one finishes the next starts.

    Stops issuing when the requests run out or ``duration_s`` has passed (in-flight requests
    are awaited). Returns the results in issue order and the wall time of the run.
    """
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    api = BACKENDS[backend] if isinstance(backend, str) else backend
    turns = Turns(requests)
    pending = list(reversed(requests))
    results: list[RequestResult] = []
    bar = tqdm(total=len(requests), desc="requests", disable=not progress, unit="req")
    t0 = time.perf_counter()
    deadline = None if duration_s is None else t0 + duration_s
    async with open_session(timeout_s) as session:

        async def user() -> None:
            while pending and (deadline is None or time.perf_counter() < deadline):
                request = pending.pop()
                await turns.ready(request)
                results.append(await send(session, base_url, api, request, prompt_text, t0))
                turns.answer(request)
                bar.update(1)

        await asyncio.gather(*(user() for _ in range(min(concurrency, len(requests)))))
    duration = time.perf_counter() - t0
    bar.close()
    return sorted(results, key=lambda r: r.start), duration


async def run_trace_replay(
    base_url: str,
    requests: Sequence[BenchRequest],
    time_scale: float = 1.0,
    backend: Backend | str = "sglang",
    prompt_text: PromptText = _no_text,
    max_concurrency: int | None = None,
    timeout_s: float = 3600.0,
    progress: bool = True,
) -> tuple[list[RequestResult], float]:
    """Send each request at its trace time × ``time_scale`` (0.1 = ten times faster).

    An optional ``max_concurrency`` caps requests in flight; a request that waits for a slot is
    sent late and its lateness shows in its ``start`` against its arrival time. A request that
    follows another (a later turn) is sent once that one is answered and its think time
    (× ``time_scale``) has passed, and not before its own arrival time.
    """
    if time_scale <= 0:
        raise ValueError("time_scale must be > 0")
    api = BACKENDS[backend] if isinstance(backend, str) else backend
    turns = Turns(requests, time_scale)
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), desc="requests", disable=not progress, unit="req")
    t0 = time.perf_counter()
    first = min((r.arrival_s for r in requests), default=0.0)

    async with open_session(timeout_s) as session:

        async def one(request: BenchRequest) -> RequestResult:
            delay = (request.arrival_s - first) * time_scale - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            await turns.ready(request)
            if slots is None:
                result = await send(session, base_url, api, request, prompt_text, t0)
            else:
                async with slots:
                    result = await send(session, base_url, api, request, prompt_text, t0)
            turns.answer(request)
            bar.update(1)
            return result

        results = await asyncio.gather(*(one(r) for r in requests))
    duration = time.perf_counter() - t0
    bar.close()
    return list(results), duration
