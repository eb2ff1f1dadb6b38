"""The stock launcher discovers the plugin: omni flags listed, a bad value stopped in one line
(each refusal of the flags' own parse: test_flags.py, in-process; of the OmniAttn checks that
run on SGLang's arguments: test/attn_runtime/test_attn_runtime_launcher.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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


def test_a_bad_omni_value_stops_the_launch_in_one_line(
    cpu_engine_env: dict[str, str], tmp_path: Path
) -> None:
    """The real launcher's refusal (each flag's own message: ``test_flags.py``, in-process)."""
    result = launch(["--model-path", str(tmp_path), "--omni-attn-pattern",
                     "/nonexistent/pattern.json"], cpu_engine_env)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, result.stderr
    assert errors[0].startswith("omniinfer: error: ")
    assert "--omni-attn-pattern: no such file" in errors[0]
