"""``child_process.ManagedProcess``, the one child-process helper: readiness by GET or POST,
exit and timeout reported with the log tail, stop and kill of the whole group."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from omniinfer.child_process import ManagedProcess, ServerFailed, free_port
from omniinfer.emulator.process import EmulatorProcess


def _emulator_command(port: int) -> list[str]:
    return [sys.executable, "-m", "omniinfer.emulator", "--profile", "cpu-smollm2", "--port",
            str(port), "--time-scale", "0.01"]


def test_ready_by_post_body_and_refused_body_times_out(tmp_path: Path) -> None:
    port = free_port()
    proc = ManagedProcess(_emulator_command(port), None, tmp_path / "a.log", port, ready_timeout_s=60,
                          ready_path="/generate",
                          ready_body={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}})
    with proc:
        assert proc.alive() and proc.ready()
        proc.ready_body = {"input_ids": []}  # the worker answers 400: not ready
        assert not proc.ready()
        proc.ready_timeout_s = 0.5
        with pytest.raises(ServerFailed, match="not ready after"):
            proc.wait_ready()
    assert not proc.alive()


def test_exit_is_reported_with_the_log_tail(tmp_path: Path) -> None:
    command = [sys.executable, "-c", "print('bad flag, giving up'); raise SystemExit(3)"]
    proc = ManagedProcess(command, None, tmp_path / "b.log", free_port(), ready_timeout_s=30)
    with pytest.raises(ServerFailed, match="exited with code 3(.|\n)*bad flag, giving up"):
        proc.start()


def test_kill_ends_the_group_at_once(tmp_path: Path) -> None:
    emu = EmulatorProcess(log_path=tmp_path / "c.log").start()
    assert emu.alive()
    emu.kill()
    assert emu.process is not None and emu.process.returncode == -signal.SIGKILL
    assert not emu.alive()
