"""The closed loop: keep exactly ``concurrency`` requests in flight until all are done."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import aiohttp
from tqdm import tqdm

from omniinfer.bench.client import RequestResult, stream_generate
from omniinfer.bench.workloads import BenchRequest


async def run_closed_loop(
    base_url: str,
    requests: Sequence[BenchRequest],
    concurrency: int,
    timeout_s: float = 600.0,
    progress: bool = True,
) -> tuple[list[RequestResult], float]:
    """Send ``requests`` with ``concurrency`` in flight; when one finishes the next starts.

    Returns the per-request results (in request order) and the wall time of the run.
    """
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    queue: asyncio.Queue[BenchRequest] = asyncio.Queue()
    for request in requests:
        queue.put_nowait(request)
    results: list[RequestResult | None] = [None] * len(requests)
    bar = tqdm(total=len(requests), desc="requests", disable=not progress, unit="req")
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    t0 = time.perf_counter()
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def worker() -> None:
            while True:
                try:
                    request = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                results[request.index] = await stream_generate(session, base_url, request, t0)
                bar.update(1)

        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(requests)))))
    duration = time.perf_counter() - t0
    bar.close()
    return [r for r in results if r is not None], duration
