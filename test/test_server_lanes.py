"""The real-server tests' lanes (test/server_lanes.py) and scripts/test.sh's process counts."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from server_lanes import (
    LANES,
    LANES_ENV,
    UnplacedServerModule,
    covers,
    lane_of,
    lane_scope,
    one_thread_each,
)

TEST_ROOT = Path(__file__).resolve().parent
SERVER_MARK = re.compile(r"^(pytestmark = .*pytest\.mark\.server|@pytest\.mark\.server)", re.M)


def _server_modules() -> set[str]:
    found = set()
    for path in TEST_ROOT.rglob("test_*.py"):
        if SERVER_MARK.search(path.read_text()):
            found.add(path.relative_to(TEST_ROOT).as_posix())
    return found


def test_every_server_module_is_in_exactly_one_lane() -> None:
    modules = _server_modules()
    assert "pd/shared_servers/test_pd_real_faults.py" in modules
    for module in modules:
        matches = [lane for lane, entries in LANES.items() for entry in entries
                   if covers(entry, module)]
        assert len(matches) == 1, (module, matches)


def test_every_lane_entry_names_a_server_module() -> None:
    modules = _server_modules()
    for entries in LANES.values():
        for entry in entries:
            assert any(covers(entry, module) for module in modules), entry


def test_lane_of_gives_the_order_and_refuses_an_unplaced_module() -> None:
    assert lane_of("pd/shared_servers/test_pd_real_outputs.py") == ("a", 0)
    assert lane_of("deploy/test_deploy_local.py") == ("a", 2)
    with pytest.raises(UnplacedServerModule, match="test/servers/test_new.py"):
        lane_of("servers/test_new.py")


def test_one_work_unit_per_lane_and_per_unplaced_module() -> None:
    assert lane_scope("test/pd/shared_servers/test_pd_real_faults.py::test_x") == "lane-a"
    assert lane_scope("test/pd/shared_servers/test_pd_real_outputs.py::test_y[1]") == "lane-a"
    assert lane_scope("test/pd/test_pd_dp_aware.py::test_z") == "lane-a"
    assert lane_scope("test/servers/test_moe_tp2.py::test_z") == "lane-b"
    assert lane_scope("test/proxy/test_cost.py::test_w") == "test/proxy/test_cost.py"


def test_one_thread_each_only_in_a_lane_worker() -> None:
    assert not one_thread_each(env := {"PYTEST_XDIST_WORKER": "gw0"}) and env.keys() == {
        "PYTEST_XDIST_WORKER"}
    assert not one_thread_each({LANES_ENV: "1"})
    env = {LANES_ENV: "1", "PYTEST_XDIST_WORKER": "gw1"}
    assert one_thread_each(env) and env["OMP_NUM_THREADS"] == "1"


def test_a_lane_workers_children_run_one_torch_thread() -> None:
    code = ("import os, sys; sys.path.insert(0, sys.argv[1]); from server_lanes import "
            "one_thread_each; one_thread_each(); import subprocess; print(subprocess.run("
            "[sys.executable, '-c', 'import torch; print(torch.get_num_threads())'],"
            " capture_output=True, text=True).stdout.strip())")
    env = {**os.environ, LANES_ENV: "1", "PYTEST_XDIST_WORKER": "gw1"}
    env.pop("OMP_NUM_THREADS", None)
    out = subprocess.run([sys.executable, "-c", code, str(TEST_ROOT)], env=env,
                         capture_output=True, text=True, check=True, timeout=120).stdout
    assert out.strip() == "1"


@pytest.mark.parametrize("name,value", [("PARALLEL", "x"), ("SERVER_PARALLEL", "0"),
                                        ("SERVER_PARALLEL", "2 ")])
def test_test_sh_refuses_a_count_that_is_not_a_whole_number(name: str, value: str) -> None:
    script = TEST_ROOT.parent / "scripts" / "test.sh"
    result = subprocess.run(["bash", str(script), "--quick"], env={**os.environ, name: value},
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert f"{name} must be a whole number" in result.stderr
