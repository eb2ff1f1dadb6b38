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


def test_a_pattern_that_does_not_fit_stops_the_launch(
    tiny_models: dict[str, Path], cpu_engine_env: dict[str, str], tmp_path: Path,
) -> None:
    """The real launcher stops in one line (each refusal's message: the test below)."""
    model = tiny_models["llama"]
    pattern = _pattern(model, tmp_path / "p.json", [0], 7)
    result = launch(["--model-path", str(model), "--device", "cpu", "--attention-backend",
                     "torch_native", "--omni-attn-pattern", str(pattern)], cpu_engine_env)
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("omniinfer: error: --omni-attn-pattern:") and "pattern has 7 layers" in last


@pytest.mark.parametrize(
    ("layers", "num_layers", "backend", "message"),
    [
        ([0], 7, "torch_native", "pattern has 7 layers"),
        ([0], None, "triton", "needs --attention-backend torch_native"),
        ([], None, "torch_native", "compresses no layer"),
    ],
)
def test_a_pattern_that_does_not_fit_is_refused_in_one_line(
    tiny_models: dict[str, Path], tmp_path: Path,
    layers: list[int], num_layers: int | None, backend: str, message: str,
) -> None:
    from omniinfer.flags import OmniConfig, OmniFlagError
    from omniinfer.sglang_plugin.omni_attn.plugin import prepare_namespace

    model = tiny_models["llama"]
    config = OmniConfig(omni_attn_pattern=str(_pattern(model, tmp_path / "p.json", layers,
                                                       num_layers)))
    with pytest.raises(OmniFlagError, match=message) as info:
        prepare_namespace(_plain_namespace(model, attention_backend=backend), config)
    assert str(info.value).startswith("--omni-attn-pattern:") and "\n" not in str(info.value)


@pytest.mark.parametrize("budget", [None, 16384])
def test_the_pool_split_is_balanced_for_the_given_budget(
    tiny_models: dict[str, Path], tmp_path: Path, budget: int | None
) -> None:
    import argparse

    from transformers import AutoConfig

    from omniinfer.attn import runtime_window as rw
    from omniinfer.flags import OmniConfig
    from omniinfer.sglang_plugin.omni_attn.plugin import prepare_namespace

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
    assert namespace.radix_cache_backend == "omni_attn"  # prefix reuse is on by default


@pytest.mark.parametrize(("searched_for", "flag", "balanced_for"),
                         [(None, None, 2048), (8192, None, 8192), (8192, 4096, 4096)])
def test_the_pools_are_balanced_for_the_patterns_context_unless_the_flag_says(
    tiny_models: dict[str, Path], tmp_path: Path, searched_for: int | None, flag: int | None,
    balanced_for: int,
) -> None:
    from transformers import AutoConfig

    from omniinfer.attn import runtime_window as rw
    from omniinfer.flags import OmniConfig
    from omniinfer.sglang_plugin.omni_attn.plugin import prepare_namespace

    model = tiny_models["llama"]
    layers = AutoConfig.from_pretrained(model).num_hidden_layers
    path = _pattern(model, tmp_path / "p.json", [0])
    if searched_for is not None:
        made = json.loads(path.read_text())
        made["provenance"]["context"] = searched_for
        path.write_text(json.dumps(made))
    namespace = _plain_namespace(model, max_total_tokens=32768)
    prepare_namespace(namespace, OmniConfig(omni_attn_pattern=str(path), omni_attn_context=flag))
    expected = rw.balanced_swa_ratio(32768, layers, 1, 4, 8, context=balanced_for,
                                     prefill_chunk=512)
    assert namespace.swa_full_tokens_ratio == expected
    if balanced_for != 2048:  # the context changes the split, so the test can tell them apart
        assert expected != rw.balanced_swa_ratio(32768, layers, 1, 4, 8, prefill_chunk=512)


def _plain_namespace(model: Path, **extra: object) -> object:
    import argparse

    values: dict[str, object] = dict(
        model_path=str(model), attention_backend="torch_native", page_size=None,
        max_total_tokens=None, chunked_prefill_size=512, max_running_requests=None,
        swa_full_tokens_ratio=None, json_model_override_args=None,
    )
    return argparse.Namespace(**{**values, **extra})


def test_disable_radix_cache_keeps_prefix_reuse_off(tiny_models: dict[str, Path],
                                                   tmp_path: Path) -> None:
    from omniinfer.flags import OmniConfig
    from omniinfer.sglang_plugin.omni_attn import radix
    from omniinfer.sglang_plugin.omni_attn.plugin import RADIX_BACKEND, prepare_namespace

    assert RADIX_BACKEND == radix.BACKEND_NAME
    model = tiny_models["llama"]
    config = OmniConfig(omni_attn_pattern=str(_pattern(model, tmp_path / "p.json", [0])))
    namespace = _plain_namespace(model, disable_radix_cache=True, radix_cache_backend=None)
    prepare_namespace(namespace, config)
    assert namespace.disable_radix_cache is True and namespace.radix_cache_backend is None


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"disaggregation_mode": "decode", "disaggregation_decode_enable_radix_cache": True},
         "does not keep the compressed layers' sink on the decode server"),
        ({"disaggregation_mode": "prefill", "attention_backend": "omni_triton", "page_size": 16},
         "transferred at page size 1 only"),
        ({"radix_cache_backend": "flexkv"}, "does not keep the sink"),
        ({"enable_hierarchical_cache": True}, "--enable-hierarchical-cache replaces"),
    ],
)
def test_what_the_sink_aware_cache_cannot_serve_is_refused_in_one_line(
    tiny_models: dict[str, Path], tmp_path: Path, extra: dict[str, object], message: str
) -> None:
    from omniinfer.flags import OmniConfig, OmniFlagError
    from omniinfer.sglang_plugin.omni_attn.plugin import prepare_namespace

    model = tiny_models["llama"]
    config = OmniConfig(omni_attn_pattern=str(_pattern(model, tmp_path / "p.json", [0])))
    with pytest.raises(OmniFlagError, match=message) as info:
        prepare_namespace(_plain_namespace(model, **extra), config)
    assert "\n" not in str(info.value)


def test_pd_at_page_size_one_is_prepared_like_a_plain_server(tiny_models: dict[str, Path],
                                                              tmp_path: Path) -> None:
    from omniinfer.flags import OmniConfig
    from omniinfer.sglang_plugin.omni_attn.plugin import RADIX_BACKEND, prepare_namespace

    model = tiny_models["llama"]
    config = OmniConfig(omni_attn_pattern=str(_pattern(model, tmp_path / "p.json", [0])))
    for mode in ("prefill", "decode"):
        namespace = _plain_namespace(model, disaggregation_mode=mode, radix_cache_backend=None)
        prepare_namespace(namespace, config)
        assert json.loads(namespace.json_model_override_args)["is_hybrid_swa"] is True
        assert namespace.radix_cache_backend == RADIX_BACKEND
