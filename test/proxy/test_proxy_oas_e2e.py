"""``oas`` end to end: OmniProxy in front of real ``omniinfer emulate-worker`` PD processes (2P1D)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from proxy_helpers import get, post, wait_until

from omniinfer.emulator.process import EmulatorProcess
from omniinfer.proxy.process import RouterProcess

BATCH_TOKENS = 1024  # --oas-batch-tokens: an instance is short of work below two of these
BIG_PROMPT = 7000  # uncached tokens of one deferral-test prompt (the profile's context is 8192)


@pytest.fixture(scope="module")
def oas_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("oas")
    with contextlib.ExitStack() as stack:
        workers = []
        for i, mode in enumerate(("prefill", "prefill", "decode")):
            worker = EmulatorProcess(mode, profile="h100-llama3-8b", time_scale=1.0,
                                     log_path=tmp / f"{mode}{i}.log")
            stack.callback(worker.stop)
            workers.append(worker.launch())  # all three start at once
        for worker in workers:
            worker.wait_ready()
        args = ["--pd-disaggregation", "--prefill-policy", "oas", "--decode-policy", "oas",
                "--access-log", str(tmp / "access.jsonl"), "--loads-poll-interval-secs", "0.2",
                "--oas-batch-tokens", str(BATCH_TOKENS)]
        for worker in workers:
            args += worker.router_args()
        router = stack.enter_context(RouterProcess(args, tmp / "router.log"))
        yield {"router": router, "access": tmp / "access.jsonl"}


def _prefill_state(router: RouterProcess) -> dict[str, Any]:
    status, info = get(router.base_url + "/server_info")
    assert status == 200, info
    return info["omniproxy"]["policy_state"]["prefill"]


def _log_lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def _flushed_rows(router: RouterProcess, path: Path, after: int, count: int,
                  keep: Callable[[dict], bool]) -> list[dict]:
    """The ``count`` access-log rows past line ``after`` that ``keep`` selects, once on disk.

    The log is flushed at most once a second, when a request is answered, so each poll sends a
    one-token request (whose row ``keep`` must reject) until the rows are there.
    """
    def rows() -> list[dict]:
        lines = path.read_text().splitlines()[after:] if path.exists() else []
        return [r for r in map(json.loads, lines) if keep(r)]

    def there() -> bool:
        if len(rows()) >= count:
            return True
        post(router.base_url + "/generate", {"text": "flush the log",
                                             "sampling_params": {"max_new_tokens": 1}})
        return False

    assert wait_until(there, timeout=60, step=0.25), f"fewer than {count} rows in {path}"
    return rows()


def test_oas_holds_prefill_requests_while_every_instance_is_busy(oas_cluster: dict) -> None:
    """24 prompts of 7,000 new tokens at once against two prefill instances. An instance takes
    one more only while it is idle, its predicted backlog is within one batch cycle, less than
    two batches (2 x 1,024 tokens) are out, or it has just reported nothing waiting; so after
    one or two per instance the rest must wait in the router until a prefill finishes. The
    router's queue must be seen holding requests, and every one must still be answered."""
    router, access = oas_cluster["router"], oas_cluster["access"]
    before = sum(_prefill_state(router)["released"].values())
    start_line = _log_lines(access)
    count = 24

    def one(i: int) -> tuple[int, Any]:
        ids = [20000 + i * BIG_PROMPT + k for k in range(BIG_PROMPT)]  # no prefix in common
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}}
        status, answer, _ = post(router.base_url + "/generate", body, timeout=120)
        return status, answer

    seen: list[int] = []

    def queued() -> int:
        seen.append(_prefill_state(router)["queued"])
        return seen[-1]

    with ThreadPoolExecutor(count) as pool:
        futures = [pool.submit(one, i) for i in range(count)]
        wait_until(lambda: queued() >= 8 or all(f.done() for f in futures), timeout=180,
                   step=0.01)
        answers = [f.result() for f in futures]
    assert [s for s, _ in answers] == [200] * count, answers
    assert max(seen) >= 8, f"the router held at most {max(seen)} back ({len(seen)} samples)"

    assert wait_until(lambda: _prefill_state(router)["queued"] == 0, timeout=10)
    state = _prefill_state(router)
    assert sum(state["released"].values()) - before == count
    rows = _flushed_rows(router, access, start_line, count,
                         lambda r: r.get("prompt_tokens") == BIG_PROMPT)
    assert len(rows) == count and all(r["status"] == 200 for r in rows)
    held = sorted(r["durations"]["prefill_waiting"] for r in rows)
    # held ones wait at least for a prefill pass of a 7,000-token prompt (0.19 s in the profile)
    assert sum(h > 0.1 for h in held) >= 8, held


def test_oas_routes_concurrent_pd_requests_with_lpt_and_the_apc_prediction(
        oas_cluster: dict) -> None:
    router, access = oas_cluster["router"], oas_cluster["access"]
    start_line = _log_lines(access)
    prefix = list(range(1000, 1512))  # 512 shared tokens = 32 APC blocks

    def one(i: int) -> tuple[int, dict]:
        ids = prefix + [5000 + i * 7 + k for k in range(40 + 60 * (i % 4))]
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4 + i % 3}}
        status, answer, _ = post(router.base_url + "/generate", body, timeout=60)
        return status, answer

    status, first = one(0)  # warms the prefix into one prefill worker
    assert status == 200 and first["meta_info"]["completion_tokens"] == 4
    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(one, range(1, 25)))
    assert [s for s, _ in answers] == [200] * 24
    assert all(a["meta_info"]["completion_tokens"] == 4 + i % 3
               for i, (_, a) in enumerate(answers, start=1))
    assert wait_until(lambda: _prefill_state(router)["queued"] == 0, timeout=10)
    assert any(i["samples"] > 0 for i in _prefill_state(router)["instances"].values())

    rows = _flushed_rows(router, access, start_line, 25,
                         lambda r: r.get("prompt_tokens", 0) > len(prefix))
    assert len(rows) == 25
    decisions = [d for r in rows for d in r["decisions"]]
    assert {d["role"] for d in decisions} == {"prefill", "decode"}
    assert {d["reason"] for d in decisions if d["role"] == "prefill"} <= {
        "idle", "open", "starved", "overdue"}
    assert {d["reason"] for d in decisions if d["role"] == "decode"} == {"lpt"}
    # the router's APC prediction against what the prefill worker reports it reused
    pairs = [(r["decisions"][0]["cached_tokens"], r["reported_cached_tokens"]) for r in rows
             if "reported_cached_tokens" in r]
    assert len(pairs) == 25
    hits = [(p, r) for p, r in pairs if p > 0]
    assert len(hits) >= 12  # the shared prefix is found
    assert sum(1 for p, r in hits if abs(p - r) < 16) / len(hits) >= 0.9
