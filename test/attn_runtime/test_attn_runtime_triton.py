"""``--attention-backend omni_triton`` with ``--omni-attn-pattern``: flag checks in process,
the backend's kernels on SGLang's real pools in a Triton-interpreter subprocess."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from omniinfer.attn.pattern import from_layers
from omniinfer.flags import OmniConfig, OmniFlagError
from omniinfer.sglang_plugin.omni_attn.plugin import prepare_namespace

HERE = Path(__file__).resolve().parent


def _namespace(model: Path, backend: str, page_size: int | None, **extra: object
               ) -> argparse.Namespace:
    return argparse.Namespace(
        model_path=str(model), attention_backend=backend, page_size=page_size,
        max_total_tokens=None, chunked_prefill_size=512, max_running_requests=None,
        swa_full_tokens_ratio=None, json_model_override_args=None, **extra)


@pytest.fixture()
def config(tiny_models: dict[str, Path], tmp_path: Path) -> OmniConfig:
    from transformers import AutoConfig

    model = tiny_models["llama"]
    made = from_layers([0], AutoConfig.from_pretrained(model), 4, 8, str(model)).to_json()
    path = tmp_path / "p.json"
    path.write_text(json.dumps(made))
    return OmniConfig(omni_attn_pattern=str(path))


@pytest.mark.parametrize("page_size", [None, 1, 16, 64])
def test_omni_triton_is_accepted_at_any_page_size(
        tiny_models: dict[str, Path], config: OmniConfig, page_size: int | None) -> None:
    namespace = _namespace(tiny_models["llama"], "omni_triton", page_size)
    prepare_namespace(namespace, config)
    overrides = json.loads(namespace.json_model_override_args)
    assert overrides["is_hybrid_swa"] is True and overrides["sliding_window"] == 7
    assert namespace.radix_cache_backend == "omni_attn"  # prefix reuse with omni_triton too


def test_torch_native_still_needs_page_size_one(tiny_models: dict[str, Path],
                                               config: OmniConfig) -> None:
    with pytest.raises(OmniFlagError, match="--page-size 16 needs --attention-backend omni_triton"):
        prepare_namespace(_namespace(tiny_models["llama"], "torch_native", 16), config)


def test_phase_backends_must_match(tiny_models: dict[str, Path], config: OmniConfig) -> None:
    namespace = _namespace(tiny_models["llama"], "omni_triton", 16,
                           decode_attention_backend="triton")
    with pytest.raises(OmniFlagError, match="--decode-attention-backend must be omni_triton"):
        prepare_namespace(namespace, config)


def test_kernels_on_real_sglang_pools_equal_the_masked_evaluator() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W",
         "ignore::UserWarning", str(HERE / "interp_omni_triton_pools.py")],
        cwd=HERE.parents[1], env=env, capture_output=True, text=True, timeout=600,
    )
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert "8 passed" in proc.stdout, tail


def test_missing_kernel_package_is_named_at_backend_creation(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ``omni_kernel_npu`` the pattern still loads (torch_native needs no kernels);
    creating the ``omni_triton`` backend fails with the package and how to install it."""
    from types import SimpleNamespace

    from omniinfer.sglang_plugin.omni_attn import triton_backend

    triton_backend.kernels.cache_clear()
    for name in [m for m in sys.modules if m.startswith("omni_kernel_npu")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "omni_kernel_npu", None)  # import fails as if absent
    try:
        layers = triton_backend.SinkRecentLayers([0], 4, 8)  # no kernel import yet
        runner = SimpleNamespace(model_config=SimpleNamespace(is_encoder_decoder=False))
        with pytest.raises(triton_backend.KernelsMissingError,
                           match="omni_kernel_npu.*pip install -e sgl-kernel-npu --no-deps"):
            triton_backend.create_backend(runner)
        with pytest.raises(triton_backend.KernelsMissingError):
            _ = layers.decode_kernel
    finally:
        triton_backend.kernels.cache_clear()
