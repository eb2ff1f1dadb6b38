"""Two real gloo ranks driving :class:`PlacementController` without an SGLang server.

Each rank is a spawned process: SGLang's expert-location metadata, its ``init_by_mapping`` and the
scheduler's rank are replaced by small fakes, the model is a dict of expert weights whose rows
say which expert they hold, and the "forward pass" is a loop that hands the controller per-slot
counts (rank 0) and ends the pass, with one all-reduce on the world group per pass so the ranks
move in lockstep as real forward passes do. What each rank saw (the pass at which its metadata
was switched, its status, the layouts ``init_by_mapping`` was asked for, its log) comes back in
a dict. Scenarios:

- ``delay_after_target``: rank 1's background thread stalls right after the ranks agreed on the
  switch pass (as a GIL-starved thread would), once;
- ``delay_every_attempt``: the same, for each of the first ``SWITCH_ATTEMPTS`` agreements;
- ``fail_init``: ``init_by_mapping`` raises on rank 1 for the first layout it is given;
- ``fail_switch``: the metadata update of the switch raises on rank 1, once, after the ranks
  agreed to switch;
- ``skew``: rank 1 counts one forward pass more than rank 0 (a pass counted twice), so it reaches
  the agreed pass one real pass before rank 0.

A rank whose forward loop raises records the error (``error``: type, message, pass) and exits,
as a scheduler does; the other rank's next collective with it then fails. Ranks that have not
both finished within ``deadline_s`` are killed and :func:`run` raises ``Hung``.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

NUM_EXPERTS, PER_RANK, RANKS, LAYERS = 4, 3, 2, 2
INITIAL_MAP = np.array([[0, 1, 2, 3, 0, 1]] * LAYERS)  # expert 3 only on rank 1
LOAD = np.array([1.0, 1.0, 1.0, 10.0])  # expert 3 is hot: B ~ 1.7 until it is replicated
STALL_S = 0.5
VOTE_TIMEOUT_S = {"skew": 4.0}  # the switch vote's bound per scenario; others: DEFAULT_VOTE_TIMEOUT_S
DEFAULT_VOTE_TIMEOUT_S = 30.0


class Hung(AssertionError):
    """The ranks did not finish in time (killed)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def expert_row(layer: int, expert: int) -> torch.Tensor:
    """The weights of ``expert`` in ``layer``: every value names them."""
    return torch.full((4,), float(100 * layer + expert))


class FakeMetadata:
    """The parts of SGLang's ExpertLocationMetadata the controller reads and updates."""

    def __init__(self, fail_updates: int = 0) -> None:
        self.fail_updates = fail_updates
        self.ep_size = RANKS
        self.num_logical_experts = NUM_EXPERTS
        self.physical_to_logical_map_cpu = torch.from_numpy(INITIAL_MAP.copy())
        self.controller: Any = None
        self.updates: list[tuple[int, list[int]]] = []

    def update(self, other: Any, update_layer_ids: list[int]) -> None:
        if self.fail_updates > 0:
            self.fail_updates -= 1
            raise RuntimeError("device lost while updating the expert map")
        for layer in update_layer_ids:
            self.physical_to_logical_map_cpu[layer] = other.physical_to_logical_map_cpu[layer]
        self.updates.append((int(self.controller.passes), list(update_layer_ids)))


class _StallingDist:
    """torch.distributed, except that the background thread's first ``stalls`` MAX all-reduces
    (the switch pass agreements) return only after a stall."""

    def __init__(self, stalls: int) -> None:
        self.stalls = stalls

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)

    def all_reduce(self, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, **kwargs: Any) -> Any:
        out = dist.all_reduce(tensor, op=op, **kwargs)
        background = threading.current_thread() is not threading.main_thread()
        if background and op == dist.ReduceOp.MAX and self.stalls > 0:
            self.stalls -= 1
            time.sleep(STALL_S)
        return out


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if record.exc_info:
            text += "\n" + logging.Formatter().formatException(record.exc_info)
        self.lines.append((record.levelname, text))


def _slot_counts(current_map: np.ndarray) -> torch.Tensor:
    """Per-slot counts of one pass: each expert's load split over its replicas."""
    out = np.zeros(current_map.shape)
    for layer, row in enumerate(current_map):
        replicas = np.bincount(row, minlength=NUM_EXPERTS)
        out[layer] = LOAD[row] / replicas[row]
    return torch.from_numpy(out * 10)


def worker(rank: int, port: int, scenario: str, passes: int, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.pop("OMNIINFER_STATE_DIR", None)
    dist.init_process_group("gloo", rank=rank, world_size=RANKS, timeout=timedelta(seconds=300))
    from sglang.srt.eplb import expert_location

    import omniinfer.sglang_plugin.ranks as ranks
    from omniinfer.flags import OmniConfig
    from omniinfer.sglang_plugin.placement import agreement, runtime

    agreement.VOTE_TIMEOUT_S = VOTE_TIMEOUT_S.get(scenario, DEFAULT_VOTE_TIMEOUT_S)
    records = _Records()
    logging.getLogger("omniinfer").addHandler(records)
    logging.getLogger("omniinfer").setLevel(logging.DEBUG)
    metadata = FakeMetadata(fail_updates=int(scenario == "fail_switch" and rank == 1))
    asked: list[list[list[int]]] = []

    def init_by_mapping(model_config: Any, mapping: torch.Tensor, moe_ep_rank: int) -> Any:
        asked.append(mapping.tolist())
        if scenario == "fail_init" and rank == 1 and len(asked) == 1:
            raise ValueError("no room for expert 3 on rank 0")
        return SimpleNamespace(physical_to_logical_map_cpu=mapping.clone())

    expert_location.get_global_expert_location_metadata = lambda: metadata
    expert_location.ExpertLocationMetadata.init_by_mapping = staticmethod(init_by_mapping)
    ranks.tp_rank = lambda: rank
    if scenario == "delay_after_target" and rank == 1:
        runtime.dist = _StallingDist(1)  # type: ignore[assignment]
    if scenario == "delay_every_attempt" and rank == 1:
        runtime.dist = _StallingDist(runtime.SWITCH_ATTEMPTS)  # type: ignore[assignment]
    mine = INITIAL_MAP[:, rank * PER_RANK:(rank + 1) * PER_RANK]
    weights = {layer: [torch.stack([expert_row(layer, int(e)) for e in mine[layer]])]
               for layer in range(LAYERS)}
    manager = SimpleNamespace(_get_model=lambda: SimpleNamespace(
        routed_experts_weights_of_layer=weights), _model_config=None)
    config = OmniConfig(enable_omni_placement=True, omni_placement_interval=5)
    controller = runtime.PlacementController(manager, config)
    metadata.controller = controller
    step = torch.zeros(1)
    error: dict[str, Any] | None = None
    if scenario == "skew" and rank == 1:
        controller.on_forward_pass_end()  # a pass counted that rank 0 does not count
    try:
        for _ in range(passes):
            if rank == 0:
                controller.on_counts(_slot_counts(metadata.physical_to_logical_map_cpu.numpy()))
            controller.on_forward_pass_end()
            dist.all_reduce(step)  # the forward pass's own collective: ranks move in lockstep
            time.sleep(0.001)
    except Exception as exc:  # a scheduler exits on it; so does this rank, below
        error = {"type": type(exc).__name__, "message": str(exc), "pass": controller.passes}
    time.sleep(0.3)  # let the background thread record what it was finishing
    live = metadata.physical_to_logical_map_cpu.numpy()
    mine = live[:, rank * PER_RANK:(rank + 1) * PER_RANK]
    weights_match = all(torch.equal(weights[layer][0][slot], expert_row(layer, int(mine[layer][slot])))
                        for layer in range(LAYERS) for slot in range(PER_RANK))
    results[rank] = {
        "updates": metadata.updates, "status": dict(controller.status), "asked": asked,
        "log": records.lines, "map": live.tolist(), "weights_match": weights_match,
        "passes": controller.passes, "error": error,
        "thread_alive": controller.thread.is_alive(),
    }
    if error is None:
        dist.barrier()
    os._exit(0)  # the background thread may sit in a collective nobody will join


def run(scenario: str, passes: int = 400, deadline_s: float = 150.0) -> dict[int, dict[str, Any]]:
    """Run both ranks to the end; returns what each saw. Raises :class:`Hung` when they have
    not both finished within ``deadline_s`` (they are killed first)."""
    import torch.multiprocessing as mp

    manager = mp.get_context("spawn").Manager()
    results = manager.dict()
    context = mp.start_processes(worker, args=(free_port(), scenario, passes, results),
                                 nprocs=RANKS, start_method="spawn", join=False)
    deadline = time.monotonic() + deadline_s
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise Hung(f"{scenario}: ranks still running after {deadline_s:g} s; finished: "
                       f"{sorted(results.keys())}")
    return {rank: results[rank] for rank in range(RANKS)}
