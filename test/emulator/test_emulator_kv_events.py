"""``emulate-worker --kv-events-config``: a real emulator process publishes SGLang's KV events,
decoded here with SGLang's own classes from the installed wheel (the wire-compatibility proof)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from emu_helpers import request, start_emulator
from sglang.srt.disaggregation.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

from omniinfer.child_process import free_port
from omniinfer.emulator.process import EmulatorProcess

DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


@pytest.fixture(scope="module")
def publishing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    port, replay = free_port(), free_port()
    config = json.dumps({"publisher": "zmq", "endpoint": f"tcp://*:{port}", "topic": "kv",
                         "replay_endpoint": f"tcp://*:{replay}"})
    emu = start_emulator(tmp_path_factory.mktemp("emu-kv"), "--kv-events-config", config,
                         "--max-total-tokens", "300")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVTIMEO, 3000)
    sub.subscribe(b"kv")
    sub.connect(f"tcp://127.0.0.1:{port}")
    try:
        yield {"emu": emu, "sub": sub, "ctx": ctx, "config": config, "replay": replay}
    finally:
        sub.close(0)
        ctx.term()
        emu.stop()


def _generate(emu: EmulatorProcess, ids: list[int]) -> dict[str, Any]:
    status, text = request(emu.url + "/generate", "POST", {
        "input_ids": ids, "sampling_params": {"max_new_tokens": 2}})
    assert status == 200, text
    return json.loads(text)


def _drain(sub: zmq.Socket[Any], quiet_s: float = 0.5) -> list[tuple[bytes, int, bytes]]:
    """Every message until none came for ``quiet_s``."""
    out = []
    sub.setsockopt(zmq.RCVTIMEO, int(quiet_s * 1000))
    while True:
        try:
            topic, seq, payload = sub.recv_multipart()
        except zmq.Again:
            return out
        out.append((topic, int.from_bytes(seq, "big", signed=True), payload))


def _sync(emu: EmulatorProcess, sub: zmq.Socket[Any]) -> int:
    """Send until the subscription is live (ZMQ drops what a PUB sends before it joins);
    then flush, so the cache is empty. Returns the next sequence number."""
    for attempt in range(20):  # each attempt waits up to 0.3 s for an event (the receive timeout)
        _generate(emu, [7000 + attempt] * 3)
        if _drain(sub, 0.3):
            assert request(emu.url + "/flush_cache", "POST")[0] == 200
            cleared = _drain(sub)
            assert [type(e) for e in DECODER.decode(cleared[-1][2]).events] == [AllBlocksCleared]
            return cleared[-1][1] + 1
    raise AssertionError("no KV events reached the subscriber in 20 attempts")


def test_emulator_publishes_store_evict_and_flush_as_sglang(publishing: dict[str, Any]) -> None:
    emu, sub = publishing["emu"], publishing["sub"]
    seq0 = _sync(emu, sub)
    a = list(range(100, 200))
    b = a[:50] + list(range(500, 560))
    assert _generate(emu, a)["meta_info"]["cached_tokens"] == 0
    assert _generate(emu, b)["meta_info"]["cached_tokens"] == 50
    messages = _drain(sub)
    assert [m[1] for m in messages] == list(range(seq0, seq0 + len(messages)))
    assert all(m[0] == b"kv" for m in messages)
    batches = [DECODER.decode(m[2]) for m in messages]
    assert all(batch.attn_dp_rank == 0 and batch.ts > 0 for batch in batches)
    stored = [e for batch in batches for e in batch.events if isinstance(e, BlockStored)]
    first = stored[0]
    assert first.token_ids == a and first.parent_block_hash is None
    assert first.block_size == 1 and len(first.block_hashes) == 100 and first.medium == "GPU"
    assert first.lora_id is None
    # A's output tokens hang under A; B's own tokens hang under token 49 of A
    by_tokens = {tuple(e.token_ids): e for e in stored}
    branch = by_tokens[tuple(range(500, 560))]
    assert branch.parent_block_hash == first.block_hashes[49]
    all_hashes = {h for e in stored for h in e.block_hashes}
    assert len(all_hashes) == sum(len(e.block_hashes) for e in stored)  # ids are unique

    c = list(range(1000, 1200))  # 200 more tokens in a 300-token pool: A and B must go
    _generate(emu, c)
    later = [e for m in _drain(sub) for e in DECODER.decode(m[2]).events]
    removed = [h for e in later if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert removed and set(removed) <= all_hashes
    assert set(first.block_hashes[50:]) <= set(removed)  # A's private part was evicted
    assert any(isinstance(e, BlockStored) and e.token_ids[:200] == c for e in later)

    assert request(emu.url + "/flush_cache", "POST")[0] == 200
    assert [type(e) for m in _drain(sub) for e in DECODER.decode(m[2]).events] == [
        AllBlocksCleared]


def test_emulator_replays_and_reports_its_publisher(publishing: dict[str, Any]) -> None:
    emu, sub = publishing["emu"], publishing["sub"]
    _sync(emu, sub)
    _generate(emu, list(range(300, 340)))
    live = _drain(sub)
    assert live
    dealer = publishing["ctx"].socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 3000)
    dealer.connect(f"tcp://127.0.0.1:{publishing['replay']}")
    try:
        dealer.send_multipart([b"", live[0][1].to_bytes(8, "big")])
        replayed = []
        while True:
            empty, topic, seq, payload = dealer.recv_multipart()
            number = int.from_bytes(seq, "big", signed=True)
            if number == -1:
                break
            replayed.append((topic, number, payload))
    finally:
        dealer.close(0)
    assert replayed == live  # same topic, sequence and bytes as the live messages
    status, text = request(emu.url + "/server_info")
    info = json.loads(text)
    assert info["kv_events_config"] == publishing["config"]
    block = info["kv_events"]
    assert block["endpoint_host"] == "*" and block["block_size"] == 1 and block["topic"] == "kv"
    assert block["replay_endpoint_port_base"] == publishing["replay"] and block["dp_size"] == 1


def test_bad_kv_events_config_and_busy_port_are_refused(tmp_path: Path) -> None:
    base = [sys.executable, "-m", "omniinfer", "emulate-worker", "--profile", "cpu-smollm2",
            "--port", str(free_port())]
    bad = subprocess.run([*base, "--kv-events-config", '{"publisher": "zmq", "endpoint": 5}'],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert "--kv-events-config: 'endpoint' must be a string" in bad.stderr
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        busy = held.getsockname()[1]
        config = json.dumps({"publisher": "zmq", "endpoint": f"tcp://*:{busy}"})
        out = subprocess.run([*base, "--kv-events-config", config], capture_output=True,
                             text=True, timeout=60)
    assert out.returncode == 1
    assert f"kv events: cannot open tcp://*:{busy}" in out.stderr
