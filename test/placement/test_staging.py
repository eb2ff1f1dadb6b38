"""Weight staging for live migrations: side stream, ready event, switch, counts off the device.

On CPU the platform's streams and events are checking no-ops, so these tests exercise the
ordering logic (who records, who waits) and the data movement, including real point-to-point
transfers between two gloo ranks.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from omniinfer import platform
from omniinfer.child_process import free_port
from omniinfer.placement.staging import HostCopy, SlotStager, StagedWeights
from omniinfer.placement.transfers import plan_slot_copies


class RecordingPlatform(platform.Platform):
    """The CPU platform, logging stream/event calls so tests can check their order."""

    def __init__(self) -> None:
        super().__init__("cpu", "gloo")
        self.log: list[str] = []
        platform_self = self

        class Event(platform.HostEvent):
            def record(self, stream: Any = None) -> None:
                platform_self.log.append("record")
                super().record(stream)

        class Stream(platform.HostStream):
            def __init__(self, name: str) -> None:
                self.name = name

            def wait_event(self, event: Any) -> None:
                platform_self.log.append(f"{self.name}.wait")
                super().wait_event(event)

        self._event_cls, self._stream_cls = Event, Stream
        self._host_stream = Stream("forward")

    def new_stream(self, device: torch.device | None = None) -> Any:
        return self._stream_cls("side")

    def new_event(self) -> Any:
        return self._event_cls()


def _weights(rank: int, layers: int = 2, per_rank: int = 3) -> dict[int, list[torch.Tensor]]:
    """Two tensors per layer, each slot filled with a value naming (rank, layer, slot)."""
    out = {}
    for layer in range(layers):
        base = torch.arange(per_rank, dtype=torch.float32) + 100 * rank + 10 * layer
        out[layer] = [base[:, None].repeat(1, 4).clone(), -base[:, None, None].repeat(1, 2, 2)]
    return out


def test_local_staging_records_once_and_switch_waits_for_it() -> None:
    plat = RecordingPlatform()
    weights = _weights(0, per_rank=4)
    old = np.array([[0, 1, 2, 3], [0, 1, 2, 3]])
    new = np.array([[0, 1, 2, 0], [3, 1, 2, 3]])  # one rank: every copy is local
    copies = plan_slot_copies(old, new, 1, [0, 1])
    stager = SlotStager(plat, rank=0, per_rank=4, weights=weights, isend=_never, irecv=_never)
    staged = stager.stage(copies)
    assert plat.log == ["record"]  # one event after the last copy, none waited yet
    assert sorted(staged.copies) == [(0, 3), (1, 0)]
    assert staged.nbytes == 2 * (4 * 4 + 4 * 4)
    before = [t.clone() for t in weights[0]]
    written = staged.switch_in(weights)
    assert plat.log == ["record", "forward.wait", "record"]  # switch waits, then marks its writes
    assert torch.equal(weights[0][0][3], before[0][0]) and torch.equal(weights[0][1][3], before[1][0])
    assert torch.equal(weights[1][0][0], torch.full((4,), 13.0))
    # the next staging reads live weights only after that switch's writes
    stager.last_switch = written
    stager.stage(plan_slot_copies(new, np.array([[1, 1, 2, 0], [3, 1, 2, 3]]), 1, [0]))
    assert plat.log[3:] == ["side.wait", "record"]


def test_switch_refuses_weights_whose_staging_never_finished() -> None:
    weights = _weights(0)
    staged = StagedWeights({(0, 1): [t[0].clone() for t in weights[0]]}, platform.HostEvent(),
                           platform.CPU)
    with pytest.raises(platform.EventNotRecorded):
        staged.switch_in(weights)
    assert torch.equal(weights[0][0][1], torch.full((4,), 1.0))  # nothing was written


def test_host_copy_waits_on_its_event() -> None:
    counts = torch.tensor([[3, 0, 5]])
    pending = HostCopy.start(counts, platform.CPU)
    counts.zero_()
    assert pending.get().tolist() == [[3, 0, 5]]
    assert pending.done.waits == 1


def _never(*_a: Any, **_k: Any) -> Any:
    raise AssertionError("a local migration must not transfer between ranks")


def _two_rank_worker(rank: int, port: int, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        weights = _weights(rank)
        # 2 ranks x 3 slots; rank 0 takes expert 4 (only on rank 1), rank 1 takes expert 0
        old = np.array([[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]])
        new = np.array([[0, 1, 4, 3, 0, 5], [0, 1, 2, 3, 4, 5]])
        copies = plan_slot_copies(old, new, 2, [0, 1])
        stager = SlotStager(platform.CPU, rank, 3, weights, group=dist.group.WORLD)
        staged = stager.stage(copies)
        staged.switch_in(weights)
        results[rank] = [t.clone() for t in weights[0]]
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_exchange_slots_point_to_point() -> None:
    manager = mp.get_context("spawn").Manager()
    results = manager.dict()
    mp.start_processes(_two_rank_worker, args=(free_port(), results), nprocs=2,
                       start_method="spawn", join=True)
    rank0, rank1 = results[0], results[1]
    # rank 0 slot 2 now holds rank 1's local slot 1 (expert 4); rank 1 slot 1 holds expert 0
    assert torch.equal(rank0[0][2], _weights(1)[0][0][1])
    assert torch.equal(rank0[1][2], _weights(1)[0][1][1])
    assert torch.equal(rank1[0][1], _weights(0)[0][0][0])
    assert torch.equal(rank0[0][:2], _weights(0)[0][0][:2])  # unchanged slots stay
