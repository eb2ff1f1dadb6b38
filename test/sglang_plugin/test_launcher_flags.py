"""The stock launcher discovers the plugin: omni flags listed, bad values stopped in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

OMNI_OPTIONS = [
    "--enable-omni-placement",
    "--omni-placement-trigger",
    "--omni-placement-margin",
    "--omni-placement-window",
    "--omni-placement-interval",
    "--omni-placement-plan",
    "--omni-attn-pattern",
]


def launch(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-W", "ignore::UserWarning", "-m", "sglang.launch_server", *args],
        env=env, capture_output=True, text=True, timeout=180,
    )


def test_help_lists_omni_flags(cpu_engine_env: dict[str, str]) -> None:
    result = launch(["--help"], cpu_engine_env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "OmniInfer:" in result.stdout
    for option in OMNI_OPTIONS:
        assert option in result.stdout, option


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--omni-attn-pattern", "/nonexistent/pattern.json"], "--omni-attn-pattern: no such file"),
        (["--omni-placement-margin", "-0.5"], "--omni-placement-margin: must be >= 0.0"),
        (["--omni-placement-window", "ten"], "--omni-placement-window: expected a number"),
    ],
)
def test_bad_omni_value_stops_launch_with_one_line(
    cpu_engine_env: dict[str, str], tmp_path: Path, args: list[str], message: str
) -> None:
    result = launch(["--model-path", str(tmp_path), *args], cpu_engine_env)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, result.stderr
    assert errors[0].startswith("omniinfer: error: ") and message in errors[0]


def test_pattern_file_must_be_json_object(cpu_engine_env: dict[str, str], tmp_path: Path) -> None:
    pattern = tmp_path / "pattern.json"
    pattern.write_text("[1, 2")
    result = launch(["--model-path", str(tmp_path), "--omni-attn-pattern", str(pattern)], cpu_engine_env)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith(
        "omniinfer: error: --omni-attn-pattern:"
    )
    assert "not valid JSON" in result.stderr
