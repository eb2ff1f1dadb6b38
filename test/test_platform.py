"""The platform module: which device type maps to which streams, events and collective library."""

from __future__ import annotations

import pytest
import torch

from omniinfer import platform


def test_cpu_platform_uses_gloo_and_host_objects() -> None:
    cpu = platform.for_device_type("cpu")
    assert cpu is platform.CPU and not cpu.is_device
    assert cpu.collective_backend == "gloo"
    assert isinstance(cpu.new_stream(), platform.HostStream)
    assert isinstance(cpu.new_event(), platform.HostEvent)
    assert platform.for_tensor(torch.zeros(2)) is cpu


def test_device_types_name_their_collective_library() -> None:
    cuda = platform.for_device_type("cuda")
    assert (cuda.device_type, cuda.collective_backend, cuda.is_device) == ("cuda", "nccl", True)
    with pytest.raises(ValueError, match="no OmniInfer platform"):
        platform.for_device_type("tpu")
    if platform._npu_module() is None:
        with pytest.raises(RuntimeError, match="torch_npu"):
            platform.for_device_type("npu")


def test_current_prefers_cuda_then_npu_then_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform, "_cuda_available", lambda: False)
    monkeypatch.setattr(platform, "_npu_module", lambda: None)
    assert platform.current() is platform.CPU
    monkeypatch.setattr(platform, "_cuda_available", lambda: True)
    assert platform.current().device_type == "cuda"


def test_host_event_must_be_recorded_before_anyone_waits() -> None:
    event = platform.HostEvent()
    stream = platform.HostStream()
    assert not event.query()
    with pytest.raises(platform.EventNotRecorded):
        stream.wait_event(event)
    with pytest.raises(platform.EventNotRecorded):
        event.synchronize()
    event.record(None)
    stream.wait_event(event)
    event.synchronize()
    assert event.query() and event.waits == 2


def test_copy_to_host_async_on_cpu_is_a_recorded_copy() -> None:
    source = torch.arange(6, dtype=torch.int64).reshape(2, 3)
    host, event = platform.CPU.copy_to_host_async(source)
    source.add_(100)  # the host copy is its own memory
    event.synchronize()
    assert torch.equal(host, torch.arange(6).reshape(2, 3))
    assert not host.is_pinned()


def test_use_stream_and_record_stream_are_no_ops_on_cpu() -> None:
    cpu = platform.CPU
    stream = cpu.new_stream()
    with cpu.use_stream(stream):
        value = torch.ones(3) * 2
    cpu.record_stream(value, stream)  # a CPU tensor: nothing to tell an allocator
    assert value.sum().item() == 6.0
