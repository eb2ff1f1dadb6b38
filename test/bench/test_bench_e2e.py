"""omniinfer bench against the real SGLang CPU server: every backend, both load modes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from omniinfer.cli import main

pytestmark = pytest.mark.server


@pytest.mark.parametrize("backend", ["sglang", "openai", "openai-chat"])
def test_closed_loop_each_backend(
    llama_server: Any, tiny_models: dict[str, Path], tmp_path: Path, backend: str
) -> None:
    code = main([
        "bench", "--base-url", llama_server.base_url, "--backend", backend,
        "--tokenizer", str(tiny_models["llama"]), "--workload", "random",
        "--num-requests", "6", "--concurrency", "3", "--input-len", "40", "--output-len", "6",
        "--output-dir", str(tmp_path), "--no-progress",
    ])
    assert code == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["completed"] == 6 and summary["errors"] == 0
    rows = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    # ignore_eos makes output lengths exact on every API
    assert all(r["output_tokens"] == r["requested_output_tokens"] == 6 for r in rows)
    assert all(r["ttft"] is not None and r["ttft"] <= r["e2e"] for r in rows)
    assert (tmp_path / "bench.png").stat().st_size > 10_000


def test_closed_loop_keeps_concurrency(llama_server: Any, tiny_models: dict[str, Path], tmp_path: Path) -> None:
    code = main([
        "bench", "--base-url", llama_server.base_url, "--tokenizer", str(tiny_models["llama"]),
        "--num-requests", "8", "--concurrency", "2", "--input-len", "16", "--output-len", "8",
        "--output-dir", str(tmp_path), "--no-progress",
    ])
    assert code == 0
    rows = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    spans = [(r["start"], r["end"]) for r in rows]
    for start, _ in spans:  # at any request start, at most 2 requests are in flight
        in_flight = sum(1 for s, e in spans if s <= start < e)
        assert in_flight <= 2


def test_shared_prefix_hits_the_servers_radix_cache(
    llama_server: Any, tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    code = main([
        "bench", "--base-url", llama_server.base_url, "--tokenizer", str(tiny_models["llama"]),
        "--workload", "shared-prefix", "--num-requests", "8", "--num-groups", "2",
        "--prefix-len", "64", "--input-len", "8", "--output-len", "2", "--concurrency", "1",
        "--output-dir", str(tmp_path), "--no-progress",
    ])
    assert code == 0
    rows = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert sum(1 for r in rows if (r["cached_tokens"] or 0) >= 64) >= 6  # all but each group's first


def test_trace_replay_honours_time_scale(
    llama_server: Any, tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    code = main([
        "bench", "--base-url", llama_server.base_url, "--tokenizer", str(tiny_models["llama"]),
        "--workload", "azure", "--replay", "--time-scale", "0.1", "--num-requests", "5",
        "--input-scale", "0.05", "--output-scale", "0.05",
        "--output-dir", str(tmp_path), "--no-progress",
    ])
    assert code == 0
    rows = sorted((json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()),
                  key=lambda r: r["index"])
    # Azure rows 0..4 arrive at 0, 4.31, ... s; at scale 0.1 request 1 starts ~0.43 s in.
    assert rows[1]["start"] == pytest.approx(0.431, abs=0.25)
    assert rows[0]["start"] < rows[1]["start"] < rows[4]["start"]


def test_unreachable_target_is_one_clear_error(tiny_models: dict[str, Path]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "omniinfer", "bench", "--base-url", "http://127.0.0.1:9",
         "--num-requests", "3", "--no-progress"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert errors[-1].startswith("omniinfer: error: cannot reach http://127.0.0.1:9")
    assert "Traceback" not in result.stderr
