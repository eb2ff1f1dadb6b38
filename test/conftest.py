"""Shared fixtures: tiny models built once per session, real SGLang servers started once."""

from __future__ import annotations

import os
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from omni_testing import LEFTOVER_GRACE_S, SESSION_PROCESSES, leftovers
from server_lanes import LANES_ENV, lane_of, lane_scheduling, one_thread_each

TEST_ROOT = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny random Llama, Qwen3 and Qwen3-MoE sharing one locally trained tokenizer."""
    from omniinfer.testbed.models import tiny

    root = tmp_path_factory.mktemp("tiny-models")
    tokenizer = tiny.train_tokenizer()
    return {
        arch: tiny.build(arch, root / arch, seed=0, tokenizer=tokenizer)
        for arch in ("llama", "qwen3", "qwen3_moe")
    }


@pytest.fixture(scope="session")
def cpu_engine_env() -> dict[str, str]:
    from omniinfer.cpu.server_env import cpu_env

    return cpu_env()


@pytest.fixture(scope="session")
def llama_server(
    tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    """One real SGLang server on the tiny Llama with the plugin loaded and an omni flag set."""
    from omniinfer.child_process import free_port
    from omniinfer.cpu.server_env import cpu_env
    from omniinfer.testbed.servers import SGLangServer, cpu_server_command

    port = free_port()
    command = cpu_server_command(
        tiny_models["llama"], port, max_total_tokens=4096,
        extra_args=["--omni-placement-window", "7"],
    )
    log = tmp_path_factory.mktemp("logs") / "llama-server.log"
    with SGLangServer(command, cpu_env(), log, port) as server:
        assert server.process is not None
        SESSION_PROCESSES.add(server.process.pid)
        yield server


class LeftoverProcess(UserWarning):
    """A test module left a process running (see ``no_process_outlives_its_module``)."""


@pytest.fixture(scope="module", autouse=True)
def no_process_outlives_its_module() -> Iterator[None]:
    """Every process a test module starts is gone when the module ends (after a grace of
    ``LEFTOVER_GRACE_S``); one that is not is killed and named in a warning in the summary. A
    leftover server or emulator would otherwise share the two cores with every later test and
    slow the rest of the suite several-fold (the kill protects the suite's time budget; the
    warning, rather than a failure, keeps an unforeseen helper process from failing a run)."""
    import psutil

    before = {child.pid for child in psutil.Process().children(recursive=True)}
    yield
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    left = leftovers(before)
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = leftovers(before)
    if not left:
        return
    described = []
    for child in left:
        try:
            described.append(f"{child.pid}: {' '.join(child.cmdline())[:200]}")
            child.kill()
        except psutil.Error:
            continue
    psutil.wait_procs(left, timeout=5)
    warnings.warn(LeftoverProcess("processes outlived their test module (killed now):\n"
                                  + "\n".join(described)), stacklevel=1)


QUICK_ENV = "OMNIINFER_TEST_QUICK"  # set by scripts/test.sh --quick (with -m "not server")


@pytest.fixture(scope="session", autouse=True)
def quick_mode_starts_no_real_server() -> Iterator[None]:
    """Under ``scripts/test.sh --quick`` a test that starts a real SGLang server (one that waits
    for it to serve: ``SGLangServer.start``) without the ``server`` mark fails, naming the
    command, so the quick selection stays what it says. Launches that stop at argument checks
    or ``--help`` start no server and stay in."""
    if os.environ.get(QUICK_ENV) != "1":
        yield
        return
    from omniinfer.testbed.servers import SGLangServer

    def refuse(self: SGLangServer) -> None:
        raise RuntimeError("this test starts a real SGLang server: mark it pytest.mark.server "
                           f"({' '.join(map(str, self.command))[:200]})")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SGLangServer, "start", refuse)
        yield


def pytest_configure(config: pytest.Config) -> None:
    # Tests start real servers in subprocesses with this interpreter's venv.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    config.addinivalue_line("markers", "server: starts a real SGLang server")
    assert sys.version_info >= (3, 10)
    one_thread_each()  # before torch starts here and before any server starts


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The ``server`` tests after the others, lane by lane (``server_lanes.LANES``) in the
    lanes' order; a module in no lane fails the collection."""
    placed: list[tuple[tuple[str, int], int, pytest.Item]] = []
    others = []
    for index, item in enumerate(items):
        if item.get_closest_marker("server") is None:
            others.append(item)
            continue
        placed.append((lane_of(item.path.resolve().relative_to(TEST_ROOT).as_posix()), index,
                       item))
    placed.sort(key=lambda entry: (entry[0], entry[1]))
    items[:] = others + [item for _, _, item in placed]


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under ``OMNIINFER_TEST_SERVER_LANES=1`` with ``--dist loadscope``: one work unit per lane
    (``server_lanes.lane_scheduling``), so each worker runs one whole lane."""
    if os.environ.get(LANES_ENV) != "1" or config.getoption("dist") != "loadscope":
        return None
    return lane_scheduling(config, log)
