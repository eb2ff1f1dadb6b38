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
