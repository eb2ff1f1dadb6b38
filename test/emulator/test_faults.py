"""The emulator's fault switches (flags and /emulator/faults) and its request log, over HTTP."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from emu_helpers import request, start_emulator, wait_until

from omniinfer.child_process import free_port
from omniinfer.emulator.process import EmulatorProcess
from omniinfer.emulator.server import EXIT_STATUS


@pytest.fixture(scope="module")
def emu(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmulatorProcess]:
    worker = start_emulator(tmp_path_factory.mktemp("faults"))
    yield worker
    worker.stop()


@pytest.fixture(autouse=True)
def _clear(emu: EmulatorProcess) -> Iterator[None]:
    yield
    if emu.alive():
        emu.clear_faults()


class Stream:
    """One streaming /generate read event by event (the test decides when to read on)."""

    def __init__(self, port: int, body: dict[str, Any]) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
        self.conn.request("POST", "/generate", json.dumps({**body, "stream": True}),
                          {"Content-Type": "application/json"})
        self.response = self.conn.getresponse()

    def next(self) -> Any:
        """The next event's payload; None when the connection ended."""
        while True:
            try:
                line = self.response.readline()
            except (http.client.IncompleteRead, ConnectionError):
                return None
            if not line:
                return None
            if line.startswith(b"data:"):
                payload = line[5:].strip().decode()
                return payload if payload == "[DONE]" else json.loads(payload)

    def rest(self) -> list[Any]:
        events = []
        while (event := self.next()) is not None:
            events.append(event)
        return events


def _body(rid: str, tokens: int = 50) -> dict[str, Any]:
    return {"text": "fault " + rid, "rid": rid, "sampling_params": {"max_new_tokens": tokens}}


def test_fail_status_answers_without_running(emu: EmulatorProcess) -> None:
    assert emu.set_faults(fail_status=503)["fail_status"] == 503
    status, text = request(emu.url + "/generate", "POST", _body("f1", 2))
    assert status == 503 and "emulated fault" in json.loads(text)["error"]["message"]
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    status, text = request(emu.url + "/v1/chat/completions", "POST", chat)
    assert status == 503 and json.loads(text)["code"] == 503  # OpenAI routes: SGLang's error shape
    assert emu.load()["num_running_reqs"] == 0
    assert emu.clear_faults()["fail_status"] == 0
    assert request(emu.url + "/generate", "POST", _body("f2", 2))[0] == 200


def test_hang_at_arrival_ends_only_by_abort(emu: EmulatorProcess) -> None:
    emu.set_faults(hang_after_tokens=0)
    stream = Stream(emu.port, _body("hung-0"))
    assert stream.response.status == 200
    assert wait_until(lambda: emu.load()["num_waiting_reqs"] == 1)  # accepted, never scheduled
    assert request(emu.url + "/abort_request", "POST", {"rid": "hung-0"})[0] == 200
    events = stream.rest()
    assert events[-1] == "[DONE]" and events[-2]["meta_info"]["finish_reason"]["type"] == "abort"
    assert events[-2]["meta_info"]["completion_tokens"] == 0
    assert emu.load()["num_waiting_reqs"] == 0
    assert {"rid": "hung-0", "abort_all": False} in [
        {k: a[k] for k in ("rid", "abort_all")} for a in emu.received()["aborts"]]


def test_hang_after_tokens_keeps_kv_and_stops_at_that_count(emu: EmulatorProcess) -> None:
    emu.set_faults(hang_after_tokens=2)
    stream = Stream(emu.port, _body("hung-2"))
    counts = [stream.next()["meta_info"]["completion_tokens"] for _ in range(2)]
    assert counts == [1, 2]
    # the request holds its place and its KV: 50 tokens would take ~0.2 s here
    assert wait_until(lambda: emu.load()["num_running_reqs"] == 1)
    assert emu.load()["num_used_tokens"] > 0
    assert request(emu.url + "/abort_request", "POST", {"rid": "hung-2"})[0] == 200
    events = stream.rest()
    assert events[-1] == "[DONE]"
    final = events[-2]["meta_info"]
    assert final["finish_reason"]["type"] == "abort" and final["completion_tokens"] == 2
    assert emu.load()["num_running_reqs"] == 0


def test_client_leaving_ends_a_hung_request(emu: EmulatorProcess) -> None:
    emu.set_faults(hang_after_tokens=0)
    stream = Stream(emu.port, _body("leaver"))
    assert wait_until(lambda: emu.load()["num_waiting_reqs"] == 1)
    stream.conn.close()
    assert wait_until(lambda: emu.load()["num_waiting_reqs"] == 0)


def test_disconnect_after_tokens_cuts_the_stream_and_the_worker_lives(emu: EmulatorProcess) -> None:
    emu.set_faults(disconnect_after_tokens=3)
    events = Stream(emu.port, _body("cut")).rest()
    assert [e["meta_info"]["completion_tokens"] for e in events] == [1, 2, 3]  # no end, no [DONE]
    assert wait_until(lambda: emu.load()["num_running_reqs"] == 0)  # aborted on the worker
    emu.clear_faults()
    status, text = request(emu.url + "/generate", "POST", _body("after-cut", 4))
    assert status == 200 and json.loads(text)["meta_info"]["completion_tokens"] == 4


def test_first_byte_delay_holds_the_answer_not_the_work(emu: EmulatorProcess) -> None:
    emu.set_faults(first_byte_delay_s=0.6)
    began = time.monotonic()
    status, text = request(emu.url + "/generate", "POST", _body("late", 2))
    waited = time.monotonic() - began
    meta = json.loads(text)["meta_info"]
    assert status == 200 and waited >= 0.6
    assert meta["request_finished_ts"] - meta["request_received_ts"] < 0.6  # done on time


def test_request_log_keeps_path_body_and_authorization(emu: EmulatorProcess) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", emu.port, timeout=20)
    body = _body("logged", 1)
    conn.request("POST", "/generate", json.dumps(body),
                 {"Content-Type": "application/json", "Authorization": "Bearer k"})
    assert conn.getresponse().status == 200
    seen = [r for r in emu.received()["requests"] if r["rid"] == "logged"]
    assert len(seen) == 1
    assert (seen[0]["path"], seen[0]["body"], seen[0]["authorization"]) == ("/generate", body, "Bearer k")


@pytest.mark.parametrize("switches,needle", [
    ({"hang": True}, "unknown fault switch"),
    ({"fail_status": 200}, "fail_status"),
    ({"hang_after_tokens": "2"}, "hang_after_tokens must be an integer"),
    ({"exit_after_tokens": -5}, "exit_after_tokens"),
    ({"first_byte_delay_s": -1}, "first_byte_delay_s"),
    ([1], "JSON object"),
])
def test_bad_fault_settings_are_refused_and_change_nothing(emu: EmulatorProcess, switches: Any,
                                                           needle: str) -> None:
    before = emu.set_faults()
    status, text = request(emu.url + "/emulator/faults", "POST", switches)
    assert status == 400 and needle in json.loads(text)["message"]
    assert emu.set_faults() == before


def test_exit_after_tokens_is_a_crash_mid_stream(tmp_path: Path) -> None:
    worker = start_emulator(tmp_path, "--fault-exit-after-tokens", "2")
    try:
        events = Stream(worker.port, _body("crash")).rest()
        assert [e["meta_info"]["completion_tokens"] for e in events] == [1, 2]
        assert worker.process is not None and worker.process.wait(timeout=10) == EXIT_STATUS
    finally:
        worker.stop()


def test_bad_fault_flag_is_refused_at_start() -> None:
    out = subprocess.run([sys.executable, "-m", "omniinfer.emulator", "--profile", "cpu-smollm2",
                          "--port", str(free_port()), "--fault-fail-status", "99"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--fault-fail-status" in out.stderr
