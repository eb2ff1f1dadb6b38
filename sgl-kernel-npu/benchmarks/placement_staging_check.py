"""OmniPlacement's real staging code on a device: SlotStager, StagedWeights.switch_in, HostCopy.

``staging_check.py`` measures the stream mechanics with plain copies; this runs the code the
placement runtime (``omniinfer.sglang_plugin.placement.runtime``) uses, imported from the
checkout (``python/``): ``omniinfer.platform`` and ``omniinfer.placement.staging``, which must
import without SGLang.

- Live expert weights as SGLang's ``routed_experts_weights_of_layer`` holds them: per MoE
  layer a gate/up tensor ``[slots, 2 * I, H]`` and a down tensor ``[slots, H, I]``.
- A migration's slot copies (``transfers.SlotCopy``) for rank 0 of two: local copies (clones
  on the stager's stream), copies received from rank 1 and copies sent to it. One GPU has no
  NCCL peer, so the transport is a stand-in passed as ``isend``/``irecv``: a receive copies
  rank 1's expert from pinned host memory into the buffer, a send copies the slot into a peer
  buffer, both on the stream the stager made current (where NCCL's wait would order them).
- Like the runtime, ``SlotStager.stage`` runs on a background thread while the main thread
  issues a GEMM "forward"; the switch then runs ``StagedWeights.switch_in`` on the forward
  stream (device-side wait on the staging event), and the live weights are compared with the
  expected experts (destinations are zeroed before every repetition). Versus: the same
  ``SlotStager`` whose stream is the forward's own stream, and the forward alone.
- ``HostCopy.start`` of an activation-count tensor right after a forward: how long the host
  spends in it (a host sync would wait for the forward), whether its event is still pending
  when it returns, and that ``get`` returns the counts; a blocking ``.cpu()`` for contrast.

On CPU (the dry run) the same code runs with the CPU platform's no-op streams and events.
Used by ``device_check.py``; only PyTorch and numpy besides the checkout.
"""

from __future__ import annotations

import importlib
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from staging_check import Forward, _Clock

REPO = Path(__file__).resolve().parents[2]


def import_placement() -> tuple[SimpleNamespace | None, dict[str, Any]]:
    """Import the platform and staging modules from the checkout; report what came with them
    (SGLang must not)."""
    src = REPO / "python"
    if str(src) not in sys.path:
        sys.path.insert(0, str(src))
    before = set(sys.modules)
    names = ("omniinfer.platform", "omniinfer.placement.staging",
             "omniinfer.placement.transfers")
    try:
        mods = [importlib.import_module(n) for n in names]
    except Exception as exc:  # reported, and the staging step is skipped
        return None, {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    added = sorted({n.split(".")[0] for n in set(sys.modules) - before} - {"omniinfer"})
    info = {"ok": True, "modules": list(names),
            "from": str(Path(mods[1].__file__).resolve().relative_to(REPO))
            if Path(mods[1].__file__).resolve().is_relative_to(REPO) else mods[1].__file__,
            "other_top_level_modules_imported": added,
            "sglang_imported": any(n == "sglang" or n.startswith("sglang.")
                                   for n in sys.modules)}
    return SimpleNamespace(platform=mods[0], staging=mods[1], transfers=mods[2]), info


class _Done:
    """A finished point-to-point request (the copy is already ordered on the stream)."""

    def wait(self) -> None:
        return None


class StandInTransport:
    """``isend``/``irecv`` for rank 0 of two on one device: receives copy rank 1's experts from
    pinned host memory, sends copy into a peer buffer; both on the current stream. The stager
    issues them in a fixed order (layers sorted, copies in order, tensors in order), so each
    call takes the next entry of the queue :meth:`begin` builds."""

    def __init__(self) -> None:
        self.recv: deque[torch.Tensor] = deque()
        self.send: deque[torch.Tensor] = deque()

    def begin(self, recv_sources: list[torch.Tensor], send_buffers: list[torch.Tensor]) -> None:
        self.recv, self.send = deque(recv_sources), deque(send_buffers)

    def irecv(self, buffer: torch.Tensor, src: int, group: Any = None, tag: int = 0) -> _Done:
        source = self.recv.popleft()
        assert source.shape == buffer.shape and src == 1, (source.shape, buffer.shape, src)
        buffer.copy_(source, non_blocking=True)
        return _Done()

    def isend(self, tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> _Done:
        peer = self.send.popleft()
        assert peer.shape == tensor.shape and dst == 1, (peer.shape, tensor.shape, dst)
        peer.copy_(tensor, non_blocking=True)
        return _Done()


def _plan(mods: SimpleNamespace, cfg: dict[str, Any]) -> list[Any]:
    """Rank 0's part of a migration: per layer ``stage_local`` local copies, ``stage_remote``
    received from rank 1 and ``stage_send`` sent to it (global slots; rank r holds
    ``[r * per_rank, (r + 1) * per_rank)``)."""
    per_rank, half = cfg["stage_slots_per_rank"], cfg["stage_slots_per_rank"] // 2
    n_local, n_remote = cfg["stage_local"], cfg["stage_remote"]
    copy = mods.transfers.SlotCopy
    copies = []
    for layer in range(cfg["stage_layers"]):
        copies += [copy(layer, half + j, j, 0, 0) for j in range(n_local)]
        copies += [copy(layer, half + n_local + j, per_rank + j, 0, 1) for j in range(n_remote)]
        copies += [copy(layer, per_rank + half + j, n_local + j, 1, 0)
                   for j in range(cfg["stage_send"])]
    assert half + n_local + n_remote <= per_rank and n_local + cfg["stage_send"] <= half
    return copies


def run_placement_staging(cfg: dict[str, Any], device: str) -> dict[str, Any]:
    """Import check, then the staging and HostCopy measurements (see the module docstring)."""
    mods, imports = import_placement()
    result: dict[str, Any] = {"imports": imports}
    print(f"  imports: {imports}")
    if mods is None:
        return result
    cuda = device == "cuda"
    plat = mods.platform.for_device_type(device)
    result["platform"] = {"current": repr(mods.platform.current()), "used": repr(plat),
                          "is_device": plat.is_device}
    dtype = torch.bfloat16 if cuda else torch.float32
    gen = torch.Generator(device=device).manual_seed(5)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    hidden, inter = cfg["stage_expert"]
    per_rank, layers = cfg["stage_slots_per_rank"], cfg["stage_layers"]
    weights = {layer: [rand(per_rank, 2 * inter, hidden), rand(per_rank, hidden, inter)]
               for layer in range(layers)}
    copies = _plan(mods, cfg)
    # what every destination must hold after the switch, and the stand-in transport's data
    expected: list[tuple[torch.Tensor, torch.Tensor]] = []  # (live destination view, value)
    recv_sources: list[torch.Tensor] = []
    send_buffers: list[torch.Tensor] = []
    for layer in range(layers):
        for c in (c for c in copies if c.layer == layer):
            for t in weights[layer]:
                if c.dst_rank == 0 and c.is_local:
                    expected.append((t[c.dst_slot % per_rank], t[c.src_slot].clone()))
                elif c.dst_rank == 0:
                    value = rand(*t.shape[1:])
                    host = plat.empty_host(value.shape, dtype)
                    host.copy_(value)
                    recv_sources.append(host)
                    expected.append((t[c.dst_slot % per_rank], value))
                else:
                    peer = torch.zeros_like(t[0])
                    send_buffers.append(peer)
                    expected.append((peer, t[c.src_slot].clone()))
    transport = StandInTransport()

    def stager_on(stream: Any = None) -> Any:
        stager = mods.staging.SlotStager(plat, 0, per_rank, weights, group=None,
                                         isend=transport.isend, irecv=transport.irecv)
        if stream is not None:
            stager.stream = stream  # staging without a stream of its own
        return stager

    side = stager_on()
    same = stager_on(plat.current_stream())
    main = plat.current_stream() if cuda else None
    result["stager"] = {
        "device": str(side.device), "weights_device": str(weights[0][0].device),
        "dedicated_stream": bool(side.stream != plat.current_stream()),
        "copies": len(copies), "local": sum(c.is_local for c in copies),
        "received": sum(c.dst_rank == 0 and not c.is_local for c in copies),
        "sent": sum(c.src_rank == 0 and not c.is_local for c in copies),
    }
    fwd = Forward(cfg, device, dtype, seed=6)
    clock, sync, alone, n_layers = fwd.clock, fwd.sync, fwd.alone, fwd.layers

    def staged_rep(stager: Any) -> dict[str, Any]:
        for live, _ in expected:
            live.zero_()
        sync()
        transport.begin(recv_sources, send_buffers)
        box: dict[str, Any] = {}

        def work() -> None:  # the runtime's background thread
            box["c0"] = clock.mark(stager.stream if cuda else None)
            t0 = time.perf_counter()
            box["staged"] = stager.stage(copies)
            box["stage_host_ms"] = (time.perf_counter() - t0) * 1e3
            box["done"] = clock.mark(stager.stream if cuda else None)

        start = clock.mark(main)
        thread = threading.Thread(target=work, name="omni-placement-check")
        thread.start()
        fwd()
        thread.join()
        end = clock.mark(main)
        staged = box["staged"]
        pending = not staged.ready.query()
        t0 = time.perf_counter()
        stager.last_switch = staged.switch_in(weights, stager.device)
        switch_host_ms = (time.perf_counter() - t0) * 1e3
        switched = clock.mark(main)
        intact = all(torch.equal(live, value) for live, value in expected)
        sync()
        return {"forward_ms": clock.ms(start, end), "copy_ms": clock.ms(box["c0"], box["done"]),
                "hidden": clock.ms(start, box["done"]) <= clock.ms(start, end),
                "switch_ms": clock.ms(end, switched), "switch_host_ms": switch_host_ms,
                "stage_host_ms": box["stage_host_ms"], "ready_pending_at_switch": pending,
                "intact": intact, "nbytes": staged.nbytes,
                "transport_drained": not transport.recv and not transport.send}

    for _ in range(2):  # warm-up of every path
        alone()
        staged_rep(side)
        staged_rep(same)
    reps: dict[str, list[Any]] = {"alone": [], "side": [], "same": []}
    for _ in range(cfg["staging_reps"]):
        reps["alone"].append(alone())
        reps["side"].append(staged_rep(side))
        reps["same"].append(staged_rep(same))
    base = statistics.median(reps["alone"])

    def med(path: str, key: str) -> float:
        return statistics.median(r[key] for r in reps[path])

    def share(path: str, key: str) -> float:
        return sum(bool(r[key]) for r in reps[path]) / len(reps[path])

    nbytes = reps["side"][0]["nbytes"]
    send_bytes = sum(b.numel() * b.element_size() for b in send_buffers)
    recv_bytes = sum(s.numel() * s.element_size() for s in recv_sources)
    result["staging"] = {
        "dtype": str(dtype).removeprefix("torch."), "gemm_mkn": list(cfg["gemm"]),
        "layers_forward": n_layers, "reps": cfg["staging_reps"],
        "staged_mb": nbytes / 2**20, "received_h2d_mb": recv_bytes / 2**20,
        "local_d2d_mb": (nbytes - recv_bytes) / 2**20, "sent_mb": send_bytes / 2**20,
        "live_weights_mb": sum(t.numel() * t.element_size() for ts in weights.values()
                               for t in ts) / 2**20,
        "forward_alone_ms": base,
        "forward_side_stream_ms": med("side", "forward_ms"),
        "forward_same_stream_ms": med("same", "forward_ms"),
        "slowdown_side_stream": med("side", "forward_ms") / base,
        "slowdown_same_stream": med("same", "forward_ms") / base,
        "copy_on_side_ms": med("side", "copy_ms"),
        "copies_hidden_in_forward": share("side", "hidden"),
        "switch_in_ms": med("side", "switch_ms"),
        "switch_in_host_ms": med("side", "switch_host_ms"),
        "stage_host_ms": med("side", "stage_host_ms"),
        "ready_pending_at_switch": share("side", "ready_pending_at_switch"),
        "intact": all(r["intact"] and r["transport_drained"]
                      for r in reps["side"] + reps["same"]),
    }
    s = result["staging"]
    print(f"  SlotStager: {s['staged_mb']:.0f} MB staged ({s['received_h2d_mb']:.0f} received "
          f"H2D, {s['local_d2d_mb']:.0f} local) + {s['sent_mb']:.0f} MB sent; forward "
          f"{base:.2f} ms ({n_layers} layers): side stream x{s['slowdown_side_stream']:.3f} "
          f"(copies {s['copy_on_side_ms']:.2f} ms), same stream x{s['slowdown_same_stream']:.3f};"
          f" switch_in {s['switch_in_ms']:.3f} ms GPU, {s['switch_in_host_ms']:.3f} ms host; "
          f"intact {s['intact']}")
    result["host_copy"] = time_host_copy(mods, plat, cfg, device, fwd, clock, main)
    return result


def time_host_copy(mods: SimpleNamespace, plat: Any, cfg: dict[str, Any], device: str,
                   fwd: Callable[[], None], clock: _Clock, main: Any) -> dict[str, Any]:
    """HostCopy of the activation counts right after a forward, vs a blocking ``.cpu()``."""
    cuda = device == "cuda"
    counts = torch.zeros(cfg["counts_shape"], dtype=torch.int64, device=device)
    rows = []
    for i in range(cfg["staging_reps"] + 2):
        fwd()
        counts.add_(1)  # the recorder's counts, produced at the end of the forward
        c0 = clock.mark(main)
        t0 = time.perf_counter()
        copy = mods.staging.HostCopy.start(counts, plat)
        issue_ms = (time.perf_counter() - t0) * 1e3
        c1 = clock.mark(main)
        pending = not copy.done.query()
        t0 = time.perf_counter()
        host = copy.get()
        wait_ms = (time.perf_counter() - t0) * 1e3
        ok = host.device.type == "cpu" and torch.equal(host, counts.cpu())
        ok = ok and (not cuda or host.is_pinned())
        fwd()
        counts.add_(1)
        t0 = time.perf_counter()
        blocking = counts.cpu()
        block_ms = (time.perf_counter() - t0) * 1e3
        ok = ok and int(blocking[0, 0]) == 2 * (i + 1)
        if i >= 2:  # first two: warm-up (pinned host memory is cached after them)
            rows.append({"issue_ms": issue_ms, "pending": pending, "wait_ms": wait_ms,
                         "gpu_ms": clock.ms(c0, c1), "block_ms": block_ms, "ok": ok})
    out = {"shape": list(cfg["counts_shape"]), "dtype": "int64", "reps": len(rows),
           "start_host_ms": statistics.median(r["issue_ms"] for r in rows),
           "start_host_max_ms": max(r["issue_ms"] for r in rows),
           "event_pending_after_start": sum(r["pending"] for r in rows) / len(rows),
           "get_wait_ms": statistics.median(r["wait_ms"] for r in rows),
           "copy_gpu_ms": statistics.median(r["gpu_ms"] for r in rows),
           "blocking_cpu_host_ms": statistics.median(r["block_ms"] for r in rows),
           "ok": all(r["ok"] for r in rows)}
    print(f"  HostCopy {out['shape']}: start {out['start_host_ms']:.3f} ms host (max "
          f"{out['start_host_max_ms']:.3f}), event pending after start in "
          f"{out['event_pending_after_start']:.0%}, get waited {out['get_wait_ms']:.2f} ms; "
          f"blocking .cpu() {out['blocking_cpu_host_ms']:.2f} ms; ok {out['ok']}")
    return out
