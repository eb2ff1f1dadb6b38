"""The suite's leftover-process check (``conftest.no_process_outlives_its_module``): it sees a
child a module left running, and spares what a session fixture owns and finished processes."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from omni_testing import SESSION_PROCESSES, leftovers

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def _children() -> set[int]:
    return {child.pid for child in psutil.Process().children(recursive=True)}


def test_a_child_left_running_is_seen_and_a_finished_one_is_not() -> None:
    before = _children()
    child = subprocess.Popen(SLEEPER)
    try:
        assert [p.pid for p in leftovers(before)] == [child.pid]
    finally:
        child.kill()
        child.wait()
    assert leftovers(before) == []


def test_a_session_fixtures_process_and_its_children_are_spared() -> None:
    before = _children()
    owner = subprocess.Popen([sys.executable, "-c",
                              "import subprocess, sys, time; "
                              f"subprocess.Popen({SLEEPER!r}); time.sleep(60)"])
    try:
        deadline = time.monotonic() + 30
        while not psutil.Process(owner.pid).children() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(leftovers(before)) == 2  # the owner and its child
        SESSION_PROCESSES.add(owner.pid)
        assert leftovers(before) == []
    finally:
        SESSION_PROCESSES.discard(owner.pid)
        for process in [*psutil.Process(owner.pid).children(recursive=True),
                        psutil.Process(owner.pid)]:
            process.kill()
        owner.wait()
