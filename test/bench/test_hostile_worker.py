"""benchmark/router/hostile_worker.py and hostile.py: the pieces of ``soak.py --hostile`` that need
no long run. The hostile worker must be admitted like an honest one (its /server_info names
publishers the router follows, its calm messages decode), its attacks must be what they say
(payloads the router's own decoders refuse or accept as intended, a replay with no end), and the
secret check must flag every planted credential and none of SGLang's ordinary fields."""

from __future__ import annotations

import json
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark" / "router"))

import hostile  # noqa: E402
import hostile_worker as hw  # noqa: E402

from omniinfer.child_process import free_port  # noqa: E402
from omniinfer.kv_event_wire import ProtocolError, decode_batch  # noqa: E402
from omniinfer.load_feed_wire import decode_load  # noqa: E402
from omniinfer.proxy.cache_truth import sources_from_server_info  # noqa: E402
from omniinfer.proxy.load_subscriber import feed_endpoints  # noqa: E402

EMULATOR_INFO = Path(__file__).resolve().parents[2] / "python" / "omniinfer" / "emulator" / \
    "sglang_0.5.23_server_info.json"


def test_the_router_would_follow_the_hostile_publishers() -> None:
    info = hw.server_info(8000, 8001, 8002, 8003, secrets=True)
    sources, page = sources_from_server_info(info, "127.0.0.1")
    assert [(s.endpoint, s.replay) for s in sources] == [("tcp://127.0.0.1:8001",
                                                          "tcp://127.0.0.1:8002")]
    assert page == hw.BLOCK_SIZE
    assert feed_endpoints(info, "127.0.0.1") == (["tcp://127.0.0.1:8003"], "load")


def test_calm_and_flood_messages_decode_as_sglang_s() -> None:
    batch = decode_batch(hw.kv_batch([hw.stored(7, 2, None, list(range(32)))]))
    assert batch.events[0].hashes == (7, 8) and batch.events[0].block_size == hw.BLOCK_SIZE
    assert decode_load(hw.load_stat([1, 2, 3, 16384, 0, 0, 3, 256, 9, 99])).num_tokens == 3
    huge = decode_batch(hw.kv_batch([hw.stored(1, 1, None, hw._HUGE_TOKENS)]))
    assert len(huge.events[0].tokens) == hw.HUGE_PAGE_TOKENS  # accepted: the router must cope


def test_extreme_loads_are_what_they_claim() -> None:
    for bad in ([1e308] * 10, [-1] * 4):
        with pytest.raises(ProtocolError):
            decode_load(hw.load_stat(bad))
    assert decode_load(hw.load_stat([2 ** 64 - 1] * 4)).num_tokens == 2 ** 64 - 1  # valid, absurd
    with pytest.raises((ProtocolError, RecursionError)):
        decode_batch(hw.nested())
    extreme = json.loads(json.dumps(hw.loads(True)))
    assert len(extreme["loads"]) == 64
    assert {1e308, -1e308} <= {v for r in extreme["loads"] for v in r.values()}


def test_the_secret_check_flags_planted_secrets_and_nothing_ordinary() -> None:
    planted = hostile.secret_fields(hw.server_info(1, 2, 3, 4, secrets=True))
    assert "$.internal_states[0].api_key" in planted
    assert any(p.endswith(".private_key") and ".vault." in p for p in planted)
    assert any(p.endswith(".clientSecret") for p in planted)
    assert hostile.secret_fields(hw.model_info(True)) and hostile.secret_fields(hw.models(True))
    assert hostile.secret_fields(hw.server_info(1, 2, 3, 4, secrets=False)) == []
    assert hostile.secret_fields(hw.models(False)) == hostile.secret_fields(hw.model_info(False))
    sglang = json.loads(EMULATOR_INFO.read_text())  # tokenizer_path, max_total_num_tokens, ...
    assert hostile.secret_fields(sglang) == []
    assert hostile.secret_fields({"api_key": None, "hf_token": "", "watermark_key": "<redacted>",
                                  "x": [{"db_password": "***"}]}) == []
    assert hostile.secret_fields({"x": [{"db_password": "hunter2"}]}) == ["$.x[0].db_password"]


def test_a_phase_fails_for_each_criterion() -> None:
    good = {"liveness_p99_ms": 3.0, "liveness_failed": 0, "rss_max_mib": 80.0,
            "honest_failed": 0, "secrets_read": 0}
    assert hostile.verdict(good) == []
    for key, value in (("liveness_p99_ms", 100.0), ("liveness_failed", 1), ("rss_max_mib", 300),
                       ("honest_failed", 1), ("secrets_read", 1)):
        assert len(hostile.verdict({**good, key: value})) == 1, key


@pytest.fixture(scope="module")
def worker() -> Iterator[dict[str, int]]:
    ports = {k: free_port() for k in ("port", "kv_port", "replay_port", "load_port")}
    proc = hostile.spawn([sys.executable, str(Path(hw.__file__)), *[
        arg for k, v in ports.items() for arg in (f"--{k.replace('_', '-')}", str(v))],
        "--huge-mib", "2"], ports["port"], Path(tempfile.mkdtemp()) / "hostile.log")
    try:
        yield ports
    finally:
        proc.kill()


def _post(port: int, path: str, body: object) -> object:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.loads(r.read())


def _replay(ctx: zmq.Context, port: int, wait_s: float) -> list[int]:  # type: ignore[type-arg]
    """Ask for a replay from 0; the sequence numbers that came within ``wait_s``."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    sock.send_multipart([b"", (0).to_bytes(8, "big", signed=True)])
    seqs: list[int] = []
    end = time.monotonic() + wait_s
    while time.monotonic() < end and sock.poll(50):
        frames = sock.recv_multipart()
        seqs.append(int.from_bytes(frames[2], "big", signed=True))
        if seqs[-1] == -1:
            break
    sock.close()
    return seqs


def test_the_worker_answers_then_attacks_on_command(worker: dict[str, int]) -> None:
    port = worker["port"]
    req = urllib.request.Request(f"http://127.0.0.1:{port}/generate",
                                 data=b'{"text": "x", "stream": true}',
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as r:
        assert r.read().rstrip().endswith(b"data: [DONE]")
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.subscribe(b"")
        sub.connect(f"tcp://127.0.0.1:{worker['kv_port']}")
        assert sub.poll(3000), "no calm KV batch"
        topic, seq, payload = sub.recv_multipart()
        assert decode_batch(payload).events and len(seq) == 8
        sub.close()
        assert _replay(ctx, worker["replay_port"], 2.0) == [-1]  # calm: the end marker at once
        _post(port, "/hostile/arm", {"attacks": ["kv-replay-endless", "control-huge"]})
        seqs = _replay(ctx, worker["replay_port"], 1.0)
        assert len(seqs) > 100 and -1 not in seqs and seqs[:3] == [0, 1, 2]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
            first = r.read()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
            second = r.read()
        sizes = sorted((len(first), len(second)))
        assert sizes[1] > 2 << 20 and hw.MARKER.encode() in min(first, second, key=len)
        msgspec.json.decode(max(first, second, key=len))  # the huge body is whole JSON
        _post(port, "/hostile/disarm", {})
        assert _replay(ctx, worker["replay_port"], 2.0) == [-1]
    finally:
        ctx.term()
