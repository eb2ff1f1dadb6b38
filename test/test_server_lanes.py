"""The real-server tests' lanes (test/server_lanes.py) and scripts/test.sh's process counts."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from server_lanes import (
    LANES,
    LANES_ENV,
    UnplacedServerModule,
    lane_of,
    lane_scope,
    pin_worker,
    worker_cores,
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
                   if module == entry or (entry.endswith("/") and module.startswith(entry))]
        assert len(matches) == 1, (module, matches)


def test_every_lane_entry_names_a_server_module() -> None:
    modules = _server_modules()
    for entries in LANES.values():
        for entry in entries:
            assert any(m == entry or (entry.endswith("/") and m.startswith(entry))
                       for m in modules), entry


def test_lane_of_gives_the_order_and_refuses_an_unplaced_module() -> None:
    assert lane_of("pd/shared_servers/test_pd_real_outputs.py") == ("a", 0)
    assert lane_of("deploy/test_deploy_local.py") == ("b", len(LANES["b"]) - 1)
    with pytest.raises(UnplacedServerModule, match="test/servers/test_new.py"):
        lane_of("servers/test_new.py")


def test_one_work_unit_per_lane_and_per_unplaced_module() -> None:
    assert lane_scope("test/pd/shared_servers/test_pd_real_faults.py::test_x") == "lane-a"
    assert lane_scope("test/pd/shared_servers/test_pd_real_outputs.py::test_y[1]") == "lane-a"
    assert lane_scope("test/pd/test_pd_dp_aware.py::test_z") == "lane-b"
    assert lane_scope("test/proxy/test_cost.py::test_w") == "test/proxy/test_cost.py"


def test_workers_get_disjoint_equal_shares_of_the_cores() -> None:
    assert worker_cores([0, 1], 0, 2) == {0}
    assert worker_cores([1, 0], 1, 2) == {1}
    assert worker_cores(range(8), 1, 2) == {4, 5, 6, 7}
    assert worker_cores([0, 1], 2, 3) == {0}  # more workers than cores: shares repeat
    assert worker_cores([3], 1, 2) == {3}
    with pytest.raises(ValueError):
        worker_cores([], 0, 1)


def test_pin_worker_pins_only_when_asked_and_only_a_worker() -> None:
    before = os.sched_getaffinity(0)
    assert pin_worker({"PYTEST_XDIST_WORKER": "gw0"}) is None
    assert pin_worker({LANES_ENV: "1"}) is None
    assert os.sched_getaffinity(0) == before


def test_pinned_worker_children_see_one_core() -> None:
    cores = sorted(os.sched_getaffinity(0))
    code = ("import os, sys; sys.path.insert(0, sys.argv[1]); from server_lanes import pin_worker;"
            "print(sorted(pin_worker())); import subprocess;"
            "print(subprocess.run(['python3', '-c', 'import os; print(sorted(os.sched_getaffinity(0)))'],"
            " capture_output=True, text=True).stdout.strip())")
    env = {**os.environ, LANES_ENV: "1", "PYTEST_XDIST_WORKER": "gw1",
           "PYTEST_XDIST_WORKER_COUNT": "2"}
    out = subprocess.run(["python3", "-c", code, str(TEST_ROOT)], env=env, capture_output=True,
                         text=True, check=True).stdout.split("\n")
    expected = str(sorted(worker_cores(cores, 1, 2)))
    assert out[0] == expected and out[1] == expected


@pytest.mark.parametrize("name,value", [("PARALLEL", "x"), ("SERVER_PARALLEL", "0"),
                                        ("SERVER_PARALLEL", "2 ")])
def test_test_sh_refuses_a_count_that_is_not_a_whole_number(name: str, value: str) -> None:
    script = TEST_ROOT.parent / "scripts" / "test.sh"
    result = subprocess.run(["bash", str(script), "--quick"], env={**os.environ, name: value},
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert f"{name} must be a whole number" in result.stderr
