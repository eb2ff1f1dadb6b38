"""``--load-feed auto`` end to end: OmniProxy reading the load of ``omniinfer emulate-worker``
processes that publish SGLang's load feed, polling those that do not, and falling back to the
poll when a feed goes silent."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from proxy_helpers import get, post, wait_until

from omniinfer.child_process import free_port
from omniinfer.emulator.process import EmulatorProcess
from omniinfer.proxy.process import RouterProcess


def _emu(log: Path, feed: bool, time_scale: float = 0.01) -> EmulatorProcess:
    kv = free_port()
    args = ["--kv-events-config", json.dumps({"publisher": "zmq", "endpoint": f"tcp://*:{kv}"})]
    if feed:
        args += ["--load-publish-endpoint", "auto"]
    return EmulatorProcess(profile="cpu-smollm2", time_scale=time_scale, extra_args=args,
                           log_path=log).start()


def _feed(router: RouterProcess, url: str) -> dict[str, Any]:
    return get(router.base_url + "/list_workers")[1]["load_feed"]["workers"][url]


def test_feed_replaces_the_poll_and_the_poll_returns_when_it_is_silent(
        tmp_logs: tuple[Path, list[Any]]) -> None:
    tmp, things = tmp_logs
    fed = _emu(tmp / "fed.log", feed=True, time_scale=0.1)  # ~10 s of generation
    things.append(fed)
    polled = _emu(tmp / "polled.log", feed=False)
    things.append(polled)
    router = RouterProcess(["--worker-urls", fed.url, polled.url, "--policy", "round_robin",
                            "--loads-poll-interval-secs", "30",  # the poll would be too late
                            "--health-check-interval-secs", "60"], tmp / "router.log")
    router.start()
    things.append(router)
    assert wait_until(lambda: _feed(router, fed.url)["load_source"] == "feed", timeout=10)
    described = _feed(router, polled.url)
    assert described["load_source"] == "poll" and "--load-publish-endpoint" in described["reason"]
    # a long generation on the fed worker shows up as running within a heartbeat or a pass,
    # long before the 30 s poll could see it
    body = {"input_ids": list(range(1, 200)), "sampling_params": {"max_new_tokens": 400,
                                                                  "ignore_eos": True}}
    answers: list[Any] = []
    threads = [threading.Thread(target=lambda: answers.append(post(router.base_url + "/generate",
                                                                   body, timeout=120)))
               for _ in range(2)]  # round robin: one to each worker
    for t in threads:
        t.start()

    def running() -> int:
        workers = get(router.base_url + "/list_workers")[1]["workers"]
        return next(w for w in workers if w["url"] == fed.url)["loads"]["running_reqs"]

    assert wait_until(lambda: running() == 1, timeout=10)
    assert _feed(router, fed.url)["ranks"][0]["readings"] >= 2
    for t in threads:
        t.join(120)
    assert [a[0] for a in answers] == [200, 200]
    assert wait_until(lambda: running() == 0, timeout=10)
    fed.stop()  # silent: stale after 5 s, then the poll serves it (and finds it gone)
    assert wait_until(lambda: _feed(router, fed.url)["load_source"] == "poll (feed stale)",
                      timeout=15)


def test_emulator_refuses_a_feed_it_cannot_advertise(tmp_path: Path) -> None:
    base = [sys.executable, "-m", "omniinfer", "emulate-worker", "--profile", "cpu-smollm2",
            "--port", str(free_port())]
    done = subprocess.run([*base, "--load-publish-endpoint", "auto"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "needs --kv-events-config" in done.stderr
    config = json.dumps({"publisher": "zmq", "endpoint": "tcp://*:5557"})
    done = subprocess.run([*base, "--kv-events-config", config, "--load-publish-endpoint",
                           "tcp://10.0.0.1:7000"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "wildcard" in done.stderr
