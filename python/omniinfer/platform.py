"""The one place that knows which device OmniInfer runs on: CUDA, Ascend NPU or CPU.

Runtime code asks a :class:`Platform` for streams, events, pinned host memory and the name of
the collective library, and never names ``torch.cuda`` / ``torch.npu`` itself. That keeps the
device paths in one small file and lets the CPU path run the same logic: its streams and events
are no-op objects, but they still check the order of operations (waiting on an event that was
never recorded raises), so CPU tests exercise the code that waits.

- CUDA: ``torch.cuda`` streams and events, NCCL.
- NPU: ``torch.npu`` (``torch_npu``) streams and events, HCCL; Triton kernels via triton-ascend.
- CPU: :class:`HostStream` / :class:`HostEvent`, gloo, plain (unpinned) host memory.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch


class EventNotRecorded(RuntimeError):
    """Something waited on an event that no stream had recorded: a bug in the ordering."""


class HostEvent:
    """CPU stand-in for a device event: work on the host is done when it is issued, so
    recording marks the event complete; waiting only checks that it was recorded."""

    def __init__(self) -> None:
        self.recorded = False
        self.waits = 0

    def record(self, stream: Any = None) -> None:
        self.recorded = True

    def query(self) -> bool:
        return self.recorded

    def synchronize(self) -> None:
        self._check()

    def wait(self, stream: Any = None) -> None:
        self._check()

    def _check(self) -> None:
        if not self.recorded:
            raise EventNotRecorded("waited on an event that was never recorded")
        self.waits += 1


class HostStream:
    """CPU stand-in for a device stream: work runs in issue order, so waits are checks."""

    def wait_event(self, event: Any) -> None:
        event.wait(self)

    def synchronize(self) -> None:
        return None


class Platform:
    """Streams, events, pinned memory and the collective backend of one device type."""

    def __init__(self, device_type: str, collective_backend: str, module: Any = None) -> None:
        self.device_type = device_type
        self.collective_backend = collective_backend
        self._module = module  # torch.cuda / torch.npu; None on CPU
        self._host_stream = HostStream()

    @property
    def is_device(self) -> bool:
        return self._module is not None

    def __repr__(self) -> str:
        return f"Platform({self.device_type}, {self.collective_backend})"

    def new_stream(self, device: torch.device | None = None) -> Any:
        """A dedicated stream, e.g. for weight staging beside the forward pass."""
        if self._module is None:
            return HostStream()
        return self._module.Stream(device=device) if device is not None else self._module.Stream()

    def current_stream(self, device: torch.device | None = None) -> Any:
        if self._module is None:
            return self._host_stream
        return self._module.current_stream(device)

    def new_event(self) -> Any:
        return HostEvent() if self._module is None else self._module.Event()

    @contextlib.contextmanager
    def use_stream(self, stream: Any) -> Iterator[None]:
        """Issue the enclosed work on ``stream`` (a no-op context on CPU)."""
        if self._module is None:
            yield
            return
        with self._module.stream(stream):
            yield

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """Tell the caching allocator ``tensor`` is used on ``stream`` too (freed safely)."""
        if self._module is not None and tensor.device.type == self.device_type:
            tensor.record_stream(stream)

    def empty_host(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """Host memory a device copies into without blocking (pinned on devices)."""
        return torch.empty(tuple(shape), dtype=dtype, pin_memory=self._module is not None)

    def copy_to_host_async(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Start copying ``tensor`` to host memory on the current stream; returns the host
        tensor and an event the reader synchronizes on before use. No host sync here."""
        host = self.empty_host(tensor.shape, tensor.dtype)
        host.copy_(tensor.detach(), non_blocking=self._module is not None and tensor.device.type
                   == self.device_type)
        event = self.new_event()
        event.record(self.current_stream(tensor.device) if self.is_device else None)
        return host, event


CPU = Platform("cpu", "gloo")


def _cuda_available() -> bool:
    return torch.cuda.is_available()


def _npu_module() -> Any:
    """``torch.npu`` when torch_npu is installed and sees a device, else None."""
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        return None
    npu = getattr(torch, "npu", None)
    return npu if npu is not None and npu.is_available() else None


@functools.cache
def for_device_type(device_type: str) -> Platform:
    """The platform serving tensors of ``device_type`` ("cuda", "npu", "cpu")."""
    if device_type == "cuda":
        return Platform("cuda", "nccl", torch.cuda)
    if device_type == "npu":
        module = _npu_module()
        if module is None:
            raise RuntimeError("device type 'npu' needs torch_npu with a visible NPU")
        return Platform("npu", "hccl", module)
    if device_type == "cpu":
        return CPU
    raise ValueError(f"no OmniInfer platform for device type {device_type!r}")


def for_tensor(tensor: torch.Tensor) -> Platform:
    """The platform of the device ``tensor`` lives on (CPU tensors get the CPU platform even on
    a GPU host: their copies need no stream)."""
    return for_device_type(tensor.device.type)


def current() -> Platform:
    """The accelerator this process would use: CUDA, then NPU, else CPU."""
    if _cuda_available():
        return for_device_type("cuda")
    if _npu_module() is not None:
        return for_device_type("npu")
    return CPU
