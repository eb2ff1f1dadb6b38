"""PD lifecycle: every PD request records the eight phases, in order, from the right events.

SGLang answers a stream's head at once, before its first event: the decode worker's head comes
while the prefill still runs, so it must not end the prefill phases. The phases after
prefill_scheduled follow the prefill worker's answer (its head: prefill_running; its end, the
prefill done: decode_waiting) and the decode worker's first output (decode_scheduled, then
decode_running when it goes to the client). Two set-ups, each in front of an in-process router
(its access log and /metrics are read):

- scripted SGLang-like workers (``router_inproc.ScriptedWorker``): heads and events timed
  exactly, so the phase boundaries can be checked against the events that make them;
- the PD emulator (``omniinfer emulate-worker``: one prefill, one decode).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from router_inproc import ScriptedWorker, router_for

from omniinfer.child_process import free_port
from omniinfer.emulator.process import EmulatorProcess
from omniinfer.proxy.config import RouterConfig
from omniinfer.proxy.request import PHASE_NAMES, REGULAR_PHASES, Lifecycle, Phase
from omniinfer.proxy.server import Serving, open_router

PREFILL_S = 0.3  # the scripted prefill's compute, after its (stream) head
KV_S = 0.2  # prefill done → the scripted decode worker's first event (KV transfer, decode queue)
TOKEN_S = 0.02  # between two scripted decode events
LATE_S = 0.6  # a late prefill answer: this long after its KV went to the decode worker
TOKENS = 3


def run(coro: Any, timeout: float = 60) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


def _sse(data: Any) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"


def _answer(text: str, tokens: int) -> dict[str, Any]:
    return {"text": text, "meta_info": {"completion_tokens": tokens, "prompt_tokens": 4,
                                        "cached_tokens": 0}}


class ScriptedPD:
    """A prefill and a decode worker that time their answers like SGLang's PD pair.

    Prefill: a stream's head at once, then its one event after ``PREFILL_S``; a non-streamed
    answer (head and body) after ``PREFILL_S``. The KV is ready (the room's event set) when the
    prefill is done; with ``late`` the prefill's answer then comes ``LATE_S`` after that.
    Decode: a stream's head at once, its first event ``KV_S`` after the KV is ready, then one
    event per ``TOKEN_S``; a non-streamed answer once all its tokens are made."""

    def __init__(self) -> None:
        self.rooms: dict[int, asyncio.Event] = {}
        self.late = False
        self.prefill = ScriptedWorker({"/generate": self._prefill})
        self.decode = ScriptedWorker({"/generate": self._decode})

    def _room(self, body: dict[str, Any]) -> asyncio.Event:
        return self.rooms.setdefault(int(body["bootstrap_room"]), asyncio.Event())

    async def _prefill(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        room = self._room(body)
        out = None
        if body.get("stream"):
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
        await asyncio.sleep(PREFILL_S)
        room.set()
        if self.late:
            await asyncio.sleep(LATE_S)
        if out is None:
            return web.json_response(_answer("x", 1))
        await out.write(_sse(_answer("x", 1)) + b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    async def _decode(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        room = self._room(body)
        if not body.get("stream"):
            await room.wait()
            await asyncio.sleep(KV_S + TOKENS * TOKEN_S)
            return web.json_response(_answer("x" * TOKENS, TOKENS))
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)  # SGLang: the head before any event
        await room.wait()
        await asyncio.sleep(KV_S)
        for i in range(1, TOKENS + 1):
            await out.write(_sse(_answer("x" * i, i)))
            await asyncio.sleep(TOKEN_S)
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out


def _config(tmp: Path, prefill: str, bootstrap_port: int, decode: str) -> RouterConfig:
    return RouterConfig(pd_disaggregation=True, prefill_urls=[(prefill, bootstrap_port)],
                        decode_urls=[decode], host="127.0.0.1", port=free_port(),
                        loads_poll_interval_secs=0, disable_health_check=True,
                        retry_initial_backoff_ms=1, access_log=str(tmp / "access.jsonl"))


async def _send(base: str, path: str, stream: bool, text: str) -> None:
    if path == "/generate":
        body: dict[str, Any] = {"text": text, "sampling_params": {"max_new_tokens": TOKENS}}
    else:
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": TOKENS,
                "model": "m"}
    async with aiohttp.ClientSession() as session:
        async with session.post(base + path, json={**body, "stream": stream}) as r:
            answer = await r.read()
            assert r.status == 200, answer
            if stream:
                assert answer.rstrip().endswith(b"data: [DONE]"), answer


def _phase_counts(metrics: str) -> dict[str, int]:
    found = re.findall(r'omniproxy_phase_duration_seconds_count\{phase="(\w+)"\} (\S+)', metrics)
    return {name: int(float(value)) for name, value in found}


async def _finished(serving: Serving, base: str, requests: int) -> tuple[list[dict[str, Any]],
                                                                        dict[str, int]]:
    """Once the router finished ``requests`` requests: their access-log records and /metrics'
    observation count per phase."""
    router = serving.router
    deadline = time.monotonic() + 10
    async with aiohttp.ClientSession() as session:
        while True:
            async with session.get(base + "/metrics") as r:
                counts = _phase_counts(await r.text())
            if counts.get("tokenize", 0) >= requests or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
    assert router.access_log is not None
    router.access_log.flush()
    path = Path(router.access_log.path)
    return [json.loads(line) for line in path.read_text().splitlines()], counts


def _assert_eight_phases(record: dict[str, Any]) -> None:
    """All eight phases entered, their enter times in phase order, each with a duration >= 0."""
    assert record["status"] == 200, record
    phases, durations = record["phases"], record["durations"]
    assert set(phases) == set(PHASE_NAMES), (sorted(set(PHASE_NAMES) - set(phases)), record)
    times = [phases[name] for name in PHASE_NAMES]
    assert times == sorted(times), record
    assert set(durations) == set(PHASE_NAMES), record
    assert all(d >= 0 for d in durations.values()), record


@pytest.fixture
def scripted(tmp_path: Path) -> Iterator[tuple[ScriptedPD, Path]]:
    yield ScriptedPD(), tmp_path


@contextlib.asynccontextmanager
async def _scripted_router(pd: ScriptedPD, tmp: Path) -> AsyncIterator[tuple[str, Serving]]:
    prefill, decode = await pd.prefill.start(), await pd.decode.start()
    config = _config(tmp, prefill, free_port(), decode)
    serving = await open_router(config)
    try:
        yield f"http://127.0.0.1:{config.port}", serving
    finally:
        await serving.close()
        await pd.prefill.close()
        await pd.decode.close()


@pytest.mark.parametrize("stream", [True, False])
def test_pd_phases_follow_the_prefill_answer_and_the_decode_output(
        scripted: tuple[ScriptedPD, Path], stream: bool) -> None:
    pd, tmp = scripted

    async def main() -> None:
        async with _scripted_router(pd, tmp) as (base, serving):
            await _send(base, "/generate", stream, "scripted")
            records, counts = await _finished(serving, base, 1)
            assert counts == {name: 1 for name in PHASE_NAMES}, counts
            [record] = records
            _assert_eight_phases(record)
            phases, durations = record["phases"], record["durations"]
            # the prefill runs PREFILL_S after it was posted: its answer ends the prefill phases
            prefill = phases["decode_waiting"] - phases["prefill_scheduled"]
            assert prefill >= PREFILL_S * 0.9, record
            if stream:  # its head came at once: the prefill ran in prefill_running
                assert durations["prefill_running"] >= PREFILL_S * 0.9, record
            # then the decode worker's first output came KV_S later (a non-streamed one after
            # its tokens too): decode_waiting, not the decode head, holds that wait
            assert durations["decode_waiting"] >= KV_S * 0.9, record
            assert record["ttft"] is None if not stream else record["ttft"] >= PREFILL_S + KV_S

    run(main())


def test_pd_phases_when_the_prefill_answer_comes_after_the_decode_output(
        scripted: tuple[ScriptedPD, Path]) -> None:
    """The decode worker's first output means the prefill is done (its KV arrived): a prefill
    answer that comes later adds nothing, and the phases it would have started are entered with
    the decode's output (no duration), never left out."""
    pd, tmp = scripted
    pd.late = True

    async def main() -> None:
        async with _scripted_router(pd, tmp) as (base, serving):
            for stream in (True, False):
                await _send(base, "/generate", stream, f"late {stream}")
            await asyncio.sleep(LATE_S)  # the late prefill answers are in
            records, counts = await _finished(serving, base, 2)
            assert counts == {name: 2 for name in PHASE_NAMES}, counts
            for record in records:
                _assert_eight_phases(record)
                phases = record["phases"]
                assert phases["decode_waiting"] <= phases["decode_scheduled"], record
                assert record["e2e"] < PREFILL_S + KV_S + LATE_S, record  # not held by it

    run(main())


@pytest.fixture(scope="module")
def emulated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmulatorProcess,
                                                                          EmulatorProcess]]:
    tmp = tmp_path_factory.mktemp("pd-lifecycle")
    prefill = EmulatorProcess("prefill", log_path=tmp / "prefill.log")
    decode = EmulatorProcess("decode", log_path=tmp / "decode.log")
    try:
        for w in (prefill, decode):
            w.launch()
        for w in (prefill, decode):
            w.wait_ready()
        yield prefill, decode
    finally:
        prefill.stop()
        decode.stop()


def test_pd_emulator_requests_record_all_eight_phases_in_order(
        emulated: tuple[EmulatorProcess, EmulatorProcess], tmp_path: Path) -> None:
    prefill, decode = emulated
    assert prefill.bootstrap_port is not None
    sends = [(path, stream, i) for path in ("/generate", "/v1/chat/completions")
             for stream in (True, False) for i in range(3)]

    async def main() -> None:
        config = _config(tmp_path, prefill.url, prefill.bootstrap_port, decode.url)
        serving = await open_router(config)
        base = f"http://127.0.0.1:{config.port}"
        try:
            await asyncio.gather(*(_send(base, path, stream, f"emulated {path} {stream} {i}")
                                   for path, stream, i in sends))
            records, counts = await _finished(serving, base, len(sends))
        finally:
            await serving.close()
        assert counts == {name: len(sends) for name in PHASE_NAMES}, counts
        assert len(records) == len(sends)
        for record in records:
            _assert_eight_phases(record)
        streamed = [r for r in records if r["stream"]]
        assert len(streamed) == len(sends) // 2 and all(r["ttft"] > 0 for r in streamed)

    run(main())


def test_lifecycle_a_phase_implies_the_earlier_phases_of_its_mode() -> None:
    life = Lifecycle("pd", now=0.0)
    for t, phase in enumerate((Phase.TOKENIZE, Phase.APC_MATCHING, Phase.PREFILL_WAITING,
                               Phase.PREFILL_SCHEDULED)):
        assert life.enter(phase, now=float(t))
    assert life.enter(Phase.DECODE_SCHEDULED, now=5.0)  # the decode's first output came first
    assert life.marks[Phase.PREFILL_RUNNING] == life.marks[Phase.DECODE_WAITING] == 5.0
    assert not life.enter(Phase.DECODE_WAITING, now=6.0)  # the late prefill answer: ignored
    assert life.enter(Phase.DECODE_RUNNING, now=4.0)  # never before the last phase entered
    life.finish(now=7.0)
    d = life.durations()
    assert list(d) == list(PHASE_NAMES) and d["prefill_scheduled"] == 2.0
    assert d["prefill_running"] == d["decode_waiting"] == d["decode_scheduled"] == 0.0
    assert d["decode_running"] == 2.0

    regular = Lifecycle("regular", now=0.0)
    regular.phases = REGULAR_PHASES
    regular.enter(Phase.TOKENIZE, now=0.0)
    regular.token(now=3.0)  # a first token implies prefill_running, not the PD-only phases
    regular.finish(now=4.0)
    assert list(regular.durations()) == [PHASE_NAMES[p] for p in REGULAR_PHASES]


async def _regular_generate(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    if not body.get("stream"):
        await asyncio.sleep(PREFILL_S)
        return web.json_response(_answer("x" * TOKENS, TOKENS))
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await out.prepare(request)
    await asyncio.sleep(PREFILL_S)
    for i in range(1, TOKENS + 1):
        await out.write(_sse(_answer("x" * i, i)))
    await out.write(b"data: [DONE]\n\n")
    await out.write_eof()
    return out


def test_regular_requests_keep_their_phases(tmp_path: Path) -> None:
    """Regular mode: no decode_waiting/decode_scheduled; a stream's first token starts
    decode_running, a non-streamed answer stays in prefill_running to its end."""
    async def main() -> None:
        worker = ScriptedWorker({"/generate": _regular_generate})
        async with router_for([worker], access_log=str(tmp_path / "access.jsonl")) as (
                base, serving):
            for stream in (True, False):
                await _send(base, "/generate", stream, f"regular {stream}")
            records, counts = await _finished(serving, base, 2)
        observed = {name: n for name, n in counts.items() if n}
        assert observed == {PHASE_NAMES[p]: 2 if p is not Phase.DECODE_RUNNING else 1
                            for p in REGULAR_PHASES}, counts
        for record in records:
            names = [PHASE_NAMES[p] for p in REGULAR_PHASES
                     if record["stream"] or p is not Phase.DECODE_RUNNING]
            assert list(record["phases"]) == names, record
            times = list(record["phases"].values())
            assert times == sorted(times), record
            # a stream's head comes at once; a non-streamed answer's head with the answer
            ran = "prefill_running" if record["stream"] else "prefill_scheduled"
            assert record["durations"][ran] >= PREFILL_S * 0.9, record

    run(main())
