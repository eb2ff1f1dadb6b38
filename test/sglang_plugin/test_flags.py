"""The omni flag table: parsing, validation and the hand-over to worker processes."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from omniinfer.flags import ENV_VAR, OmniConfig, OmniFlagError, add_arguments, current_config


def parse(argv: list[str]) -> OmniConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return OmniConfig.from_namespace(parser.parse_args(argv))


def test_defaults_are_the_benchmarked_planner() -> None:
    """What ships is what was measured: the drift benchmarks' planner (upstream's 1.1 / 0.05
    stay one flag away)."""
    from omniinfer.placement.dynamic import DynamicConfig

    config = parse([])
    assert config == OmniConfig()
    planner = DynamicConfig()
    assert (config.omni_placement_trigger, config.omni_placement_margin,
            config.omni_placement_predictor) == (planner.trigger, planner.margin,
                                                 planner.predictor)
    assert config.non_default() == {}


def test_values_are_converted_and_exported(tmp_path: Path) -> None:
    pattern = tmp_path / "p.json"
    pattern.write_text('{"version": 1}')
    config = parse(["--enable-omni-placement", "--omni-placement-window", "5",
                    "--omni-attn-pattern", str(pattern)])
    assert config.omni_placement_window == 5 and isinstance(config.omni_placement_window, int)
    env: dict[str, str] = {}
    config.export(env)
    assert json.loads(env[ENV_VAR])["omni_attn_pattern"] == str(pattern)
    assert current_config(env) == config
    assert config.non_default() == {
        "enable_omni_placement": True, "omni_placement_window": 5, "omni_attn_pattern": str(pattern)
    }


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--omni-placement-trigger", "0.9"], "must be >= 1.0"),
        (["--omni-placement-interval", "0"], "must be >= 1"),
        (["--omni-placement-window", "2.5"], "expected a number"),
        (["--omni-placement-margin", "abc"], "expected a number"),
        (["--omni-attn-pattern", "/no/such/file.json"], "no such file"),
        (["--omni-placement-plan", "/no/such/plan.json"], "no such file"),
        (["--omni-attn-context", "0"], "must be >= 1"),
        (["--omni-placement-predictor", "last", "--omni-placement-window", "5"],
         "--omni-placement-window: predictor 'last' has no moving-average span"),
        (["--omni-placement-predictor", "window", "--omni-placement-window", "1001"],
         "--omni-placement-window: a span must be at most 1000 windows, got 1001"),
        (["--omni-placement-window", "100000000"],
         "--omni-placement-window: a span must be at most 1000 windows, got 100000000"),
    ],
)
def test_bad_values_raise_one_line(argv: list[str], fragment: str) -> None:
    with pytest.raises(OmniFlagError) as info:
        parse(argv)
    assert fragment in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(("flag", "content", "match"), [
    ("--omni-placement-plan", "{}", "needs --enable-omni-placement"),  # placement is off
    ("--omni-attn-pattern", "[1, 2, 3]", "JSON object"),
    ("--omni-attn-pattern", "[1, 2", "is not valid JSON"),
])
def test_a_file_flag_is_refused(tmp_path: Path, flag: str, content: str, match: str) -> None:
    path = tmp_path / "flag.json"
    path.write_text(content)
    with pytest.raises(OmniFlagError, match=match):
        parse([flag, str(path)])


def test_attn_context_needs_a_pattern() -> None:
    with pytest.raises(OmniFlagError, match="--omni-attn-context: needs --omni-attn-pattern"):
        parse(["--omni-attn-context", "8192"])


def test_environment_config_is_validated() -> None:
    assert current_config({}) == OmniConfig()
    with pytest.raises(OmniFlagError, match="unknown omni setting"):
        current_config({ENV_VAR: '{"omni_typo": 1}'})
    with pytest.raises(OmniFlagError, match="not valid JSON"):
        current_config({ENV_VAR: "{"})
    with pytest.raises(OmniFlagError, match="must be >= 1.0"):
        current_config({ENV_VAR: '{"omni_placement_trigger": 0.5}'})


def test_the_window_span_is_bounded_at_launch() -> None:
    """``window`` keeps N windows of shares and averages them per decision: N is bounded (the
    help says so), and the bound itself is accepted for every predictor that has a span."""
    from omniinfer.placement.dynamic import MAX_SPAN, WINDOW_ARGS

    assert MAX_SPAN == 1000
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert f"at most {MAX_SPAN}" in " ".join(parser.format_help().split())
    for predictor in WINDOW_ARGS:
        config = parse(["--omni-placement-predictor", predictor,
                        "--omni-placement-window", str(MAX_SPAN)])
        assert config.omni_placement_window == MAX_SPAN
