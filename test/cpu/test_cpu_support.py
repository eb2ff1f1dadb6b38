"""CPU support: detection, import shims, the torch fill-ins and the expert-parallel MoE fix."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
import torch

from omniinfer.cpu import detect, import_shims
from omniinfer.cpu.moe_native import masked_moe_forward


def run_python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_detection_needs_the_cpu_engine_variable() -> None:
    assert not detect.cpu_engine_active({})
    assert not detect.cpu_engine_active({"SGLANG_USE_CPU_ENGINE": "0"})
    # This machine has neither a CUDA driver nor torch_npu.
    assert detect.cpu_engine_active({"SGLANG_USE_CPU_ENGINE": "1"})
    assert not detect.kernel_shim_wanted({"SGLANG_USE_CPU_ENGINE": "1", detect.KERNEL_SHIM_ENV: "0"})


def test_shim_finder_serves_kernels_that_fail_clearly_when_called() -> None:
    meta_path: list[object] = []
    added = import_shims.install(meta_path, torchvision=True)
    assert sorted(f.package for f in added) == ["sgl_kernel", "torchvision"]
    finder = next(f for f in added if f.package == "sgl_kernel")
    spec = finder.find_spec("sgl_kernel.elementwise")
    assert spec is not None
    module = finder.create_module(spec)
    with pytest.raises(import_shims.KernelUnavailableError, match="sgl_kernel.elementwise.rmsnorm"):
        module.rmsnorm(torch.zeros(1))
    with pytest.raises(ModuleNotFoundError):
        finder.find_spec("sgl_kernel.scalar_type")
    assert finder.find_spec("sgl_kernel_other") is None
    assert import_shims.install(meta_path, torchvision=True) == []  # idempotent


def test_startup_hook_installs_shims_only_on_the_cpu_engine(cpu_engine_env: dict[str, str]) -> None:
    code = (
        "import sgl_kernel, torchvision.transforms as T\n"
        "from sgl_kernel import silu_and_mul\n"
        "print(getattr(sgl_kernel, '__omniinfer_shim__', False))\n"
        "try:\n    silu_and_mul(None)\nexcept NotImplementedError as e:\n    print('raised', e)\n"
    )
    on = run_python(code, cpu_engine_env)
    assert on.returncode == 0, on.stderr
    assert on.stdout.splitlines()[0] == "True"
    assert "not available on the CPU engine" in on.stdout
    off_env = {k: v for k, v in cpu_engine_env.items() if k != "SGLANG_USE_CPU_ENGINE"}
    off = run_python("import sgl_kernel", off_env)
    assert off.returncode != 0  # without the variable nothing is shimmed


def reference_moe(x, weights, ids, w13, w2):  # type: ignore[no-untyped-def]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if e < 0:
                continue
            gate, up = (w13[e] @ x[t]).chunk(2)
            out[t] += weights[t, k] * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    return out


def test_masked_moe_skips_remote_experts_and_counts_duplicates() -> None:
    torch.manual_seed(0)
    tokens, hidden, inter, experts = 6, 8, 4, 3
    x = torch.randn(tokens, hidden)
    w13 = torch.randn(experts, 2 * inter, hidden)
    w2 = torch.randn(experts, hidden, inter)
    ids = torch.tensor([[0, 1], [-1, 2], [-1, -1], [2, 2], [1, -1], [0, 0]])
    weights = torch.rand(tokens, 2)
    got = masked_moe_forward(x, weights, ids, w13, w2, "silu")
    assert torch.allclose(got, reference_moe(x, weights, ids, w13, w2), atol=1e-5)
    assert torch.count_nonzero(got[2]) == 0  # both experts of token 2 live on another rank


def test_masked_moe_rejects_unknown_activation() -> None:
    x = torch.randn(1, 4)
    with pytest.raises(NotImplementedError, match="activation"):
        masked_moe_forward(x, torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.long),
                           torch.randn(1, 4, 4), torch.randn(1, 4, 2), "relu2")


def test_pynccl_argument_is_bound_by_name_in_installed_sglang() -> None:
    from sglang.srt.distributed.parallel_state import GroupCoordinator

    from omniinfer.sglang_plugin import cpu_fixes

    position = list(inspect.signature(GroupCoordinator.__init__).parameters).index("use_pynccl")
    positional = ("self", [[0, 1]], 0, "gloo", True, False)
    args, kwargs = cpu_fixes._without_pynccl(*positional)
    assert args[position] is False and kwargs == {}
    assert [a for i, a in enumerate(args) if i != position] == [
        a for i, a in enumerate(positional) if i != position]
    args, kwargs = cpu_fixes._without_pynccl("self", [[0, 1]], 0, "gloo", use_pynccl=True)
    assert args[position] is False and "use_pynccl" not in kwargs  # the same call, normalised
    args, kwargs = cpu_fixes._without_pynccl("self", group_ranks=[[0, 1]], use_pynccl=True)
    assert kwargs["use_pynccl"] is False and args == ("self", [[0, 1]])  # local_rank: gap


def test_torch_fill_ins() -> None:
    from omniinfer.cpu.torch_compat import patch_torch

    patch_torch()
    assert torch.cuda.is_current_stream_capturing() is False
    assert torch.cpu.is_current_stream_capturing() is False
    torch.cuda.synchronize()
    torch.cpu.empty_cache()
