"""PNG plots of a run: TTFT CDF and output-token throughput over time."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from omniinfer.bench.client import RequestResult


def plot_run(results: Sequence[RequestResult], duration_s: float, path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in results if r.ok and r.ttft is not None]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    ttft = np.sort([r.ttft for r in done]) if done else np.array([])
    if ttft.size:
        left.step(ttft, np.arange(1, ttft.size + 1) / ttft.size, where="post")
    left.set_xlabel("TTFT (s)")
    left.set_ylabel("fraction of requests")
    left.set_title("TTFT CDF")
    left.grid(alpha=0.3)

    bins = max(10, min(60, int(duration_s)))
    edges = np.linspace(0.0, max(duration_s, 1e-6), bins + 1)
    tokens = np.zeros(bins)
    for r in done:
        # Spread each request's output tokens evenly between its first token and its end.
        first = r.start + (r.ttft or 0.0)
        stamps = np.linspace(first, max(first, r.end), max(r.output_tokens, 1))
        tokens += np.histogram(stamps, edges)[0]
    width = edges[1] - edges[0]
    right.plot(edges[:-1] + width / 2, tokens / width)
    right.set_xlabel("time since start (s)")
    right.set_ylabel("output tokens / s")
    right.set_title("Output throughput over time")
    right.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
