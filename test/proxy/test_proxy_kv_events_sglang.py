"""The real SGLang 0.5.23 engine with ``--kv-events-config``: OmniProxy in ``--cache-truth
kv-events`` mode follows what it stores and evicts, and reads its load feed
(``--load-publish-endpoint auto``) instead of polling (one small CPU server, tiny Llama)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from proxy_helpers import get, post, wait_until

from omniinfer.child_process import free_port
from omniinfer.cpu.server_env import cpu_env
from omniinfer.proxy.process import RouterProcess
from omniinfer.testbed.servers import SGLangServer, cpu_server_command

pytestmark = pytest.mark.server
BLOCK = 16
POOL = 1024  # KV tokens of the server: five 200-token prompts evict a sixth


@pytest.fixture(scope="module")
def cluster(tiny_models: dict[str, Path],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("kv-events-sglang")
    port, kv = free_port(), free_port()
    config = json.dumps({"publisher": "zmq", "endpoint": f"tcp://*:{kv}", "topic": "kv"})
    command = cpu_server_command(tiny_models["llama"], port, max_total_tokens=POOL,
                                 extra_args=["--kv-events-config", config,
                                             "--load-publish-endpoint", "auto",
                                             "--chunked-prefill-size", "512"])
    with SGLangServer(command, cpu_env(), tmp / "server.log", port) as server:
        base = ["--worker-urls", server.base_url, "--apc-block-size", str(BLOCK),
                "--model-path", str(tiny_models["llama"])]
        with RouterProcess([*base, "--cache-truth", "kv-events"], tmp / "events.log") as events, \
                RouterProcess(base, tmp / "own.log") as own:
            yield {"server": server, "events": events, "own": own, "kv": kv}


def _send(router: Any, ids: list[int]) -> int:
    status, answer, _ = post(router.base_url + "/generate", {
        "input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0,
                                              "ignore_eos": True}}, timeout=120)
    assert status == 200, answer
    return int(answer["meta_info"]["cached_tokens"])


def _truth(router: Any, url: str) -> dict[str, Any]:
    return get(router.base_url + "/list_workers")[1]["cache_truth"]["workers"][url]


def _tally(router: Any, label: str) -> dict[str, int]:
    tally = get(router.base_url + "/list_workers")[1]["cache_prediction"].get(label, {})
    return {k: tally.get(k, 0) for k in ("exact", "over", "under")}


def _quiet(router: Any, url: str, seconds: float = 0.6) -> None:
    """Wait until no new batch arrived for ``seconds`` (the worker's events are all in)."""
    last, since = None, time.monotonic()
    deadline = since + 30
    while time.monotonic() < deadline:
        seq = _truth(router, url)["sources"][0]["last_seq"]
        if seq != last:
            last, since = seq, time.monotonic()
        elif seq is not None and time.monotonic() - since >= seconds:
            return
        time.sleep(0.1)
    raise AssertionError(f"events never settled: {_truth(router, url)}")


def _prompt(seed: int, n: int = 200) -> list[int]:
    return [(seed * 131 + i * 7) % 1000 + 10 for i in range(n)]


def test_sglang_events_drive_the_router_index(cluster: dict[str, Any]) -> None:
    server, events, own = cluster["server"], cluster["events"], cluster["own"]
    url = server.base_url
    info = get(url + "/server_info")[1]
    assert info["kv_events"]["endpoint_port_base"] == cluster["kv"]
    truth = _truth(events, url)
    assert truth["cache_truth"] == "kv-events"
    assert truth["sources"][0]["endpoint"] == f"tcp://127.0.0.1:{cluster['kv']}"
    page = truth["worker_page_size"]
    assert page == info["kv_events"]["block_size"] == 1  # SGLang on CPU pages by one token
    for i in range(20):  # until the subscription is live (ZMQ drops what comes before)
        _send(events, _prompt(900 + i, 20))
        if _truth(events, url)["sources"][0]["last_seq"] is not None:
            break
        time.sleep(0.2)
    _quiet(events, url)

    p = _prompt(1)
    assert _send(own, p) == 0  # routed by the other router: this one learns it from events
    _quiet(events, url)
    learned = _truth(events, url)
    assert learned["router_blocks"] >= len(p) // BLOCK
    assert (learned["malformed_events"], learned["orphan_pages"]) == (0, 0)
    assert learned["sources"][0]["gaps"] == 0 and learned["sources"][0]["malformed"] == 0
    before = _tally(events, "kv-events")
    assert _send(events, p) == len(p) - 1
    after = _tally(events, "kv-events")
    assert after["exact"] == before["exact"] + 1, (before, after)  # 192 of 199: whole blocks

    for seed in range(2, 8):  # 1200 tokens through a 1024-token pool: p goes
        _send(events, _prompt(seed))
    _quiet(events, url)
    assert _truth(events, url)["removed_pages"] >= len(p)
    own_before, before = _tally(own, "router"), _tally(events, "kv-events")
    reported = _send(own, p)  # the router's own index still promises p
    assert reported < BLOCK
    assert _tally(own, "router")["over"] == own_before["over"] + 1
    _quiet(events, url)  # p is stored again by that request; the events say so
    assert _send(events, p) == len(p) - 1
    assert _tally(events, "kv-events") == {**before, "exact": before["exact"] + 1}
    assert wait_until(lambda: "omniproxy_cache_prediction_total" in get(
        events.base_url + "/metrics")[1], timeout=5)


def test_sglang_load_feed_drives_the_router_loads(cluster: dict[str, Any], tmp_path: Path) -> None:
    """The router finds the real server's load feed, takes its readings as the worker's loads
    (the poll stands aside), and the emulator advertises the feed with the same keys."""
    server, events = cluster["server"], cluster["events"]
    url = server.base_url
    block = get(url + "/server_info")[1]["kv_events"]
    assert block["load_endpoint_port_base"] == cluster["kv"] + 1 and block["load_topic"] == "load"
    def feed() -> dict[str, Any]:
        return get(events.base_url + "/list_workers")[1]["load_feed"]["workers"][url]

    assert wait_until(lambda: feed()["load_source"] == "feed", timeout=15), feed()
    described = feed()
    assert described["ranks"][0]["endpoint"] == f"tcp://127.0.0.1:{cluster['kv'] + 1}"
    before = described["ranks"][0]["readings"]
    _send(events, _prompt(4242, 300))  # a prefill batch publishes a reading at its end
    assert wait_until(lambda: feed()["ranks"][0]["readings"] > before, timeout=10), feed()
    polled = get(url + "/v1/loads")[1]["loads"][0]

    def loads() -> dict[str, Any]:
        return next(w for w in get(events.base_url + "/list_workers")[1]["workers"]
                    if w["url"] == url)["loads"]

    assert loads()["max_total_tokens"] == polled["max_total_num_tokens"], (loads(), polled)
    assert loads()["max_running_reqs"] == polled["max_running_requests"], (loads(), polled)
    # the idle server's last reading carries the prefill just done (published on change)
    assert wait_until(lambda: loads()["prefill_uncached_tokens"]
                      == polled["total_prefill_uncached_tokens"] > 0, timeout=5), (loads(), polled)

    from omniinfer.emulator.process import EmulatorProcess

    kv = free_port()
    emulated = EmulatorProcess(profile="cpu-smollm2", extra_args=[
        "--kv-events-config", json.dumps({"publisher": "zmq", "endpoint": f"tcp://*:{kv}",
                                          "topic": "kv"}),
        "--load-publish-endpoint", "auto"], log_path=tmp_path / "emulator.log").start()
    try:
        theirs = get(emulated.url + "/server_info")[1]["kv_events"]
    finally:
        emulated.stop()
    assert set(theirs) == set(block)
    assert {k: v for k, v in theirs.items() if "port" not in k} == \
        {k: v for k, v in block.items() if "port" not in k}
