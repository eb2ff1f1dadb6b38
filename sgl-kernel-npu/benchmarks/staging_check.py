"""Placement staging mechanics on a device: does copying expert weights slow the forward?

OmniPlacement moves expert weights while the model keeps serving. On a GPU that only works if
the copies run on their own stream and the consumer (the atomic switch) waits on an event
recorded after them, not on the whole device. This measures a GEMM "forward" (a loop of bf16
matrix products sized like an MoE layer) three ways, interleaved rep by rep so clock drift hits
all equally:

- alone;
- while the experts are copied host (pinned) -> device and device -> device on a side stream;
  the forward's stream then waits on the copies' event only and checks the staged weights;
- with the same copies issued on the forward's own stream (what staging without a device
  stream amounts to).

On CPU (the dry run) there are no streams: the same steps run as plain copies, for coverage.
Used by ``device_check.py``; only PyTorch.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


class _Clock:
    """Start/stop marks on a stream (CUDA events) or wall clock (CPU), read after a sync."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"

    def mark(self, stream: Any = None) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def ms(self, start: Any, end: Any) -> float:
        if not self.cuda:
            return (end - start) * 1e3
        return start.elapsed_time(end)


def _forward(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, h: torch.Tensor,
             y: torch.Tensor, layers: int) -> None:
    """``layers`` times up- then down-projection, into preallocated outputs (no allocator
    traffic that could itself synchronise streams)."""
    for _ in range(layers):
        torch.matmul(x, w1, out=h)
        torch.matmul(h, w2, out=y)


def _experts(cfg: dict[str, Any], device: str, dtype: torch.dtype
             ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor], int]:
    """(src, dst) copy pairs: host->device ones from pinned memory, then device->device ones;
    the expected device contents; total bytes."""
    gen = torch.Generator(device=device).manual_seed(0)
    shape = cfg["expert_shape"]
    pairs, expected = [], []
    for i in range(cfg["experts_h2d"] + cfg["experts_d2d"]):
        src = torch.randn(*shape, generator=gen, device=device).to(dtype)
        if i < cfg["experts_h2d"] and device == "cuda":
            host = torch.empty(*shape, dtype=dtype, pin_memory=True)
            host.copy_(src)
            pairs.append((host, torch.empty_like(src)))
        else:
            pairs.append((src.clone(), torch.empty_like(src)))
        expected.append(src)
    nbytes = sum(s.numel() * s.element_size() for s, _ in pairs)
    return pairs, expected, nbytes


def _copy_all(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for src, dst in pairs:
        dst.copy_(src, non_blocking=True)


def _intact(pairs: list[tuple[torch.Tensor, torch.Tensor]], expected: list[torch.Tensor]
            ) -> bool:
    return all(torch.equal(dst, exp) for (_, dst), exp in zip(pairs, expected, strict=True))


def _calibrate(fwd: Callable[[int], None], clock: _Clock, target_ms: float) -> int:
    """Layers for a forward of about ``target_ms`` (2 when no target, e.g. the dry run)."""
    if target_ms <= 0:
        return 2
    fwd(4)  # warm-up (cuBLAS heuristics, clocks)
    torch.cuda.synchronize()
    start = clock.mark()
    fwd(8)
    end = clock.mark()
    torch.cuda.synchronize()
    per_layer = clock.ms(start, end) / 8
    return max(1, round(target_ms / per_layer))


class Forward:
    """The GEMM "forward" staging must hide behind, sized to about ``cfg["forward_ms"]``; one
    call runs it on the current stream, ``alone()`` times one call."""

    def __init__(self, cfg: dict[str, Any], device: str, dtype: torch.dtype, seed: int) -> None:
        self.cuda = device == "cuda"
        self.clock = _Clock(device)
        self.main = torch.cuda.current_stream() if self.cuda else None
        gen = torch.Generator(device=device).manual_seed(seed)
        m, k, n = cfg["gemm"]
        self.x = torch.randn(m, k, generator=gen, device=device).to(dtype)
        self.w1 = (torch.randn(k, n, generator=gen, device=device) / k ** 0.5).to(dtype)
        self.w2 = (torch.randn(n, k, generator=gen, device=device) / n ** 0.5).to(dtype)
        self.h = torch.empty(m, n, dtype=dtype, device=device)
        self.y = torch.empty_like(self.x)
        self.layers = _calibrate(self._run, self.clock, cfg["forward_ms"])

    def _run(self, layers: int) -> None:
        _forward(self.x, self.w1, self.w2, self.h, self.y, layers)

    def __call__(self) -> None:
        self._run(self.layers)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def alone(self) -> float:
        """Milliseconds of one forward with nothing beside it."""
        start = self.clock.mark(self.main)
        self()
        end = self.clock.mark(self.main)
        self.sync()
        return self.clock.ms(start, end)


def run_staging(cfg: dict[str, Any], device: str) -> dict[str, Any]:
    """Time the forward alone, with side-stream staging and with same-stream staging."""
    cuda = device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    fwd = Forward(cfg, device, dtype, seed=1)
    clock, main, sync, alone, layers = fwd.clock, fwd.main, fwd.sync, fwd.alone, fwd.layers
    pairs, expected, nbytes = _experts(cfg, device, dtype)
    side = torch.cuda.Stream() if cuda else None

    def reset() -> None:
        for _, dst in pairs:
            dst.zero_()
        sync()

    def side_stream() -> tuple[float, float, bool, bool]:
        """Forward ms, copy ms, copies done before the forward ended, staged data intact."""
        reset()
        start = clock.mark(main)
        if cuda:
            side.wait_event(start)  # the zeroing above is ordered before the copies
            with torch.cuda.stream(side):
                c0 = clock.mark(side)
                _copy_all(pairs)
                done = clock.mark(side)
        else:
            c0 = clock.mark()
            _copy_all(pairs)
            done = clock.mark()
        fwd()
        end = clock.mark(main)
        if cuda:
            main.wait_event(done)  # the consumer waits for the staged copies only
        intact = _intact(pairs, expected)
        sync()
        copy_ms = clock.ms(c0, done)
        return clock.ms(start, end), copy_ms, clock.ms(start, done) <= clock.ms(start, end), intact

    def same_stream() -> tuple[float, bool]:
        reset()
        start = clock.mark(main)
        _copy_all(pairs)
        fwd()
        end = clock.mark(main)
        intact = _intact(pairs, expected)
        sync()
        return clock.ms(start, end), intact

    for _ in range(2):  # warm-up of every path
        alone()
        side_stream()
        same_stream()
    t_alone, t_side, t_copy, t_same, overlapped, intact = [], [], [], [], [], []
    for _ in range(cfg["staging_reps"]):
        t_alone.append(alone())
        fwd_ms, copy_ms, hidden, ok_side = side_stream()
        t_side.append(fwd_ms)
        t_copy.append(copy_ms)
        overlapped.append(hidden)
        same_ms, ok_same = same_stream()
        t_same.append(same_ms)
        intact += [ok_side, ok_same]
    base = statistics.median(t_alone)
    h2d = cfg["experts_h2d"] if cuda else 0
    one = pairs[0][0].numel() * pairs[0][0].element_size()
    result = {
        "streams": cuda, "dtype": str(dtype).removeprefix("torch."), "gemm_mkn": list(cfg["gemm"]),
        "layers": layers, "reps": cfg["staging_reps"], "staged_mb": nbytes / 2**20,
        "h2d_mb": h2d * one / 2**20, "d2d_mb": (nbytes - h2d * one) / 2**20,
        "forward_alone_ms": base, "forward_side_stream_ms": statistics.median(t_side),
        "same_stream_ms": statistics.median(t_same), "copy_on_side_ms": statistics.median(t_copy),
        "copies_hidden_in_forward": sum(overlapped) / len(overlapped),
        "slowdown_side_stream": statistics.median(t_side) / base,
        "slowdown_same_stream": statistics.median(t_same) / base,
        "intact": all(intact),
    }
    print(f"  forward {base:.2f} ms ({layers} layers); side stream "
          f"{result['forward_side_stream_ms']:.2f} ms (x{result['slowdown_side_stream']:.3f}, "
          f"copies {result['copy_on_side_ms']:.2f} ms); same stream "
          f"{result['same_stream_ms']:.2f} ms (x{result['slowdown_same_stream']:.3f}); "
          f"intact {result['intact']}")
    return result
