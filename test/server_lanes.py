"""Two lanes for the real-server tests, so that ``scripts/test.sh`` runs them two at a time.

A real SGLang server spends most of its start in single-threaded imports (about 26 of 38 s here),
and many tests wait on a server more than they compute, so two test modules side by side finish
well before the same two one after the other. Two conditions keep that safe on a 2-core machine:

- **One OpenMP thread per process.** Under ``OMNIINFER_TEST_SERVER_LANES=1`` each pytest-xdist
  worker sets ``OMP_NUM_THREADS=1`` for itself and every server, router and emulator it starts
  (:func:`one_thread_each`). No server then waits at an OpenMP barrier for a thread of its own
  that the other lane's work has descheduled (the several-fold slowdown two servers with two
  threads each show), and the kernel still spreads the processes over both cores. (Pinning each
  lane to one core was tried: a lane with four PD servers then took 2.5 times as long.)
- **Memory.** The lanes are fixed (``--dist loadscope`` with :func:`lane_scheduling`, one work
  unit per lane, so a package-scoped deployment starts once): the deployments of several
  SmolLM2 or SmolLM2-MoE servers (2 to 3 GB each) are all in lane ``a``, one after the other,
  while lane ``b`` runs tiny-model servers and at most two SmolLM2-sized ones.

Every module with ``server`` tests must be in exactly one lane (:func:`lane_of` refuses one that
is not, at collection): a new module is placed where the lanes stay balanced (the durations
``pytest`` prints at the end of a run). Without xdist the lanes run one after the other, in
this order, lane ``a`` first.
"""

from __future__ import annotations

import os
from typing import Any

LANES_ENV = "OMNIINFER_TEST_SERVER_LANES"

# Paths relative to test/, a folder ending in "/"; each lane runs in the order given.
LANES: dict[str, tuple[str, ...]] = {
    "a": (
        "pd/shared_servers/",  # two prefill, one decode and one plain server, then two victims
        "pd/test_pd_dp_aware.py",  # two data-parallel ranks per PD server
        "deploy/test_deploy_local.py",  # SmolLM2-MoE 1P1D, two ranks per server
    ),
    "b": (
        # the session's tiny Llama server (conftest.llama_server) serves these three
        "servers/test_server_llama.py",
        "proxy/test_proxy_sglang.py",
        "bench/test_bench_e2e.py",
        "proxy/test_proxy_kv_events_sglang.py",  # its own tiny-Llama servers
        "attn_runtime/test_attn_radix_pressure.py",
        "attn_runtime/test_attn_radix_server.py",
        "attn_runtime/test_attn_runtime_server.py",
        "attn_runtime/test_attn_runtime_triton_server.py",
        "attn_runtime/test_attn_search_to_server.py",
        "servers/test_moe_tp2.py",
        "servers/test_omni_placement_server.py",
        "servers/test_moe_smollm2_server.py",  # SmolLM2-MoE: one server, then two ranks
        "attn_runtime/test_attn_shipped_4k_server.py",  # SmolLM2 at 4K
    ),
}


class UnplacedServerModule(LookupError):
    """A module with ``server`` tests that no lane names."""


def covers(entry: str, module_path: str) -> bool:
    """Whether a lane entry (a module, or a folder ending in ``/``) names this module."""
    return module_path == entry or (entry.endswith("/") and module_path.startswith(entry))


def lane_of(module_path: str) -> tuple[str, int]:
    """The lane of a test module (path relative to ``test/``, ``/``-separated) and its position
    in that lane; a module no lane names raises :class:`UnplacedServerModule`."""
    for lane, entries in LANES.items():
        for position, entry in enumerate(entries):
            if covers(entry, module_path):
                return lane, position
    raise UnplacedServerModule(
        f"test/{module_path} starts real servers but is in no lane of test/server_lanes.py: "
        "add it to the lane that keeps the two balanced")


def one_thread_each(environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """In a pytest-xdist worker under :data:`LANES_ENV` = ``1``, set ``OMP_NUM_THREADS=1`` in
    ``environ`` (this worker's environment, which every process it starts inherits; PyTorch
    reads it when it starts its thread pool). Returns whether it did."""
    if environ.get(LANES_ENV) != "1" or not environ.get("PYTEST_XDIST_WORKER", "").startswith(
            "gw"):
        return False
    environ["OMP_NUM_THREADS"] = "1"
    return True


def lane_scope(nodeid: str) -> str:
    """The work unit of a test id (relative to the repository root): its lane, or its module
    when no lane names the module."""
    module = nodeid.split("::", 1)[0]
    try:
        return "lane-" + lane_of(module.removeprefix("test/"))[0]
    except UnplacedServerModule:
        return module


def lane_scheduling(config: Any, log: Any) -> Any:
    """pytest-xdist's ``loadscope`` scheduler with one scope per lane: every test of a lane's
    modules goes to the worker that took the lane, in collection order (the lane's order). A
    module in no lane keeps its own scope. (``--dist loadgroup`` would be the declared way, but
    with pytest 9 its group suffix never reaches the scheduler.)"""
    from xdist.scheduler import LoadScopeScheduling

    class LaneScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return lane_scope(nodeid)

    return LaneScheduling(config, log)
