"""Staging expert weights beside the forward pass, and switching them in without a host sync.

Used by :mod:`omniinfer.sglang_plugin.placement.runtime`; device specifics come from
:mod:`omniinfer.platform` only:

- :class:`SlotStager` copies the slots of a migration into new buffers on a dedicated stream
  (local clones, or point-to-point transfers over the weights' collective group: NCCL/HCCL on
  devices, gloo on CPU) and records one event after the last copy;
- :meth:`StagedWeights.switch_in` runs at the switch pass on the forward stream: the stream
  waits for that event (device-side; the host does not block) and copies the staged slots into
  the live weights, so the switch waits only for the staged copies, not for the device;
- :class:`HostCopy` takes the recorder's activation counts off the device with a non-blocking
  copy into pinned memory; the background thread synchronizes on its event before reading.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from omniinfer.placement.transfers import SlotCopy
from omniinfer.platform import Platform

# isend/irecv as torch.distributed spells them; injectable so the logic runs without a group.
Send = Callable[..., Any]


@dataclasses.dataclass
class StagedWeights:
    """New tensors for (layer, local slot), valid once ``ready`` has completed."""

    copies: dict[tuple[int, int], list[torch.Tensor]]
    ready: Any  # the event recorded after the last staged copy
    platform: Platform

    @property
    def nbytes(self) -> int:
        return int(sum(t.numel() * t.element_size() for ts in self.copies.values() for t in ts))

    def switch_in(self, weights: Mapping[int, Sequence[torch.Tensor]],
                  device: torch.device | None = None) -> Any:
        """Copy every staged slot into ``weights`` on the current (forward) stream, after it
        has waited for the staging event; returns an event recorded after those writes."""
        consumer = self.platform.current_stream(device)
        consumer.wait_event(self.ready)
        for (layer, local_slot), tensors in self.copies.items():
            for live, new in zip(weights[layer], tensors, strict=True):
                live[local_slot].copy_(new)
                self.platform.record_stream(new, consumer)
        written = self.platform.new_event()
        written.record(consumer if self.platform.is_device else None)
        return written


@dataclasses.dataclass
class HostCopy:
    """A device tensor on its way to host memory; :meth:`get` waits for it."""

    host: torch.Tensor
    done: Any

    @classmethod
    def start(cls, tensor: torch.Tensor, platform: Platform) -> HostCopy:
        host, event = platform.copy_to_host_async(tensor)
        return cls(host, event)

    def get(self) -> torch.Tensor:
        self.done.synchronize()
        return self.host


class SlotStager:
    """Stages the slot copies of one rank on a dedicated stream (see the module docstring)."""

    def __init__(self, platform: Platform, rank: int, per_rank: int,
                 weights: Mapping[int, Sequence[torch.Tensor]], group: Any = None,
                 isend: Send | None = None, irecv: Send | None = None) -> None:
        self.platform = platform
        self.rank, self.per_rank = rank, per_rank
        self.weights = weights
        self.group = group
        first = next((ts[0] for ts in weights.values() if len(ts)), None)
        # Streams are per device and a background thread's current device is not the rank's,
        # so the stream is made here, for the weights' device.
        self.device = first.device if first is not None and platform.is_device else None
        self.stream = platform.new_stream(self.device)
        self.last_switch: Any = None  # event after the previous switch's writes
        if isend is None or irecv is None:
            import torch.distributed as dist

            isend, irecv = isend or dist.isend, irecv or dist.irecv
        self._isend, self._irecv = isend, irecv

    def stage(self, copies: Sequence[SlotCopy]) -> StagedWeights:
        """Issue every copy this rank takes part in, layer by layer (bounds traffic in flight);
        returns once the transfers are issued and waited on the side stream."""
        staged: dict[tuple[int, int], list[torch.Tensor]] = {}
        # Sources are live weights: read them only after the previous switch wrote them.
        if self.last_switch is not None:
            self.stream.wait_event(self.last_switch)
        with self.platform.use_stream(self.stream):
            for layer in sorted({c.layer for c in copies}):
                requests = []
                live = self.weights[layer]
                for index, copy in enumerate(c for c in copies if c.layer == layer):
                    src_local = copy.src_slot % self.per_rank
                    dst_local = copy.dst_slot % self.per_rank
                    tags = [index * len(live) + k for k in range(len(live))]
                    if copy.dst_rank == self.rank:
                        if copy.is_local:
                            staged[(layer, dst_local)] = [t[src_local].clone() for t in live]
                            continue
                        buffers = [torch.empty_like(t[dst_local]) for t in live]
                        staged[(layer, dst_local)] = buffers
                        requests += [self._irecv(b, src=copy.src_rank, group=self.group, tag=tag)
                                     for b, tag in zip(buffers, tags, strict=True)]
                    elif copy.src_rank == self.rank:
                        requests += [
                            self._isend(t[src_local].contiguous(), dst=copy.dst_rank,
                                        group=self.group, tag=tag)
                            for t, tag in zip(live, tags, strict=True)
                        ]
                for request in requests:
                    request.wait()  # on devices: the side stream waits for the transfer
            ready = self.platform.new_event()
            ready.record(self.stream if self.platform.is_device else None)
        return StagedWeights(staged, ready, self.platform)
