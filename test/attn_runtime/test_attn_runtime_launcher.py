"""--omni-attn-pattern on the stock launcher: a pattern that does not fit stops it in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from omniinfer.attn.pattern import from_layers


def launch(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-W", "ignore::UserWarning", "-m", "sglang.launch_server", *args],
        env=env, capture_output=True, text=True, timeout=300,
    )


def _pattern(model: Path, path: Path, layers: list[int], num_layers: int | None = None) -> Path:
    from transformers import AutoConfig

    made = from_layers(layers, AutoConfig.from_pretrained(model), 4, 8, str(model)).to_json()
    if num_layers is not None:
        made["model"]["num_layers"] = num_layers
    path.write_text(json.dumps(made))
    return path


@pytest.mark.parametrize(
    ("layers", "num_layers", "backend", "message"),
    [
        ([0], 7, "torch_native", "pattern has 7 layers"),
        ([0], None, "triton", "needs --attention-backend torch_native"),
        ([], None, "torch_native", "compresses no layer"),
    ],
)
def test_a_pattern_that_does_not_fit_stops_the_launch(
    tiny_models: dict[str, Path], cpu_engine_env: dict[str, str], tmp_path: Path,
    layers: list[int], num_layers: int | None, backend: str, message: str,
) -> None:
    model = tiny_models["llama"]
    pattern = _pattern(model, tmp_path / "p.json", layers, num_layers)
    result = launch(["--model-path", str(model), "--device", "cpu", "--attention-backend", backend,
                     "--omni-attn-pattern", str(pattern)], cpu_engine_env)
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("omniinfer: error: --omni-attn-pattern:") and message in last


@pytest.mark.parametrize("budget", [None, 16384])
def test_the_pool_split_is_balanced_for_the_given_budget(
    tiny_models: dict[str, Path], tmp_path: Path, budget: int | None
) -> None:
    import argparse

    from transformers import AutoConfig

    from omniinfer.attn import runtime_window as rw
    from omniinfer.flags import OmniConfig
    from omniinfer.sglang_plugin.omni_attn import prepare_namespace

    model = tiny_models["llama"]
    layers = AutoConfig.from_pretrained(model).num_hidden_layers
    pattern = _pattern(model, tmp_path / "p.json", [0])
    namespace = argparse.Namespace(
        model_path=str(model), attention_backend="torch_native", page_size=None,
        max_total_tokens=budget, chunked_prefill_size=512, max_running_requests=None,
        swa_full_tokens_ratio=None, json_model_override_args=None,
    )
    prepare_namespace(namespace, OmniConfig(omni_attn_pattern=str(pattern)))
    if budget is None:  # nothing to balance against: the fixed-headroom default
        assert namespace.swa_full_tokens_ratio == rw.default_swa_ratio(4, 8)
    else:
        assert namespace.swa_full_tokens_ratio == rw.balanced_swa_ratio(
            budget, layers, 1, 4, 8, prefill_chunk=512)
    assert namespace.disable_radix_cache is True
