"""A hostile worker's ZMQ side, run as its own process so it floods as fast as a CPU allows
without sharing the router's event loop or GIL.

    python hostile_peer.py flood PORT SECONDS TOPIC_HEX PAYLOAD_HEX
        bind a PUB socket on 127.0.0.1:PORT and send ``topic | seq | payload`` (seq counting
        from 0) as fast as possible for SECONDS, after a short wait for subscribers.
    python hostile_peer.py replay PORT SECONDS PAYLOAD_BYTES [OFFSET]
        bind a ROUTER socket on 127.0.0.1:PORT; answer each replay request ``[b"", start]``
        with batches ``start + OFFSET, start + OFFSET + 1, ...`` of PAYLOAD_BYTES bytes each,
        for SECONDS, never sending the end-of-replay marker.
"""

from __future__ import annotations

import sys
import time

import zmq


def flood(port: int, seconds: float, topic: bytes, payload: bytes) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUB)
    sock.setsockopt(zmq.SNDHWM, 0)  # never drop on our side: the subscriber's queue decides
    sock.bind(f"tcp://127.0.0.1:{port}")
    time.sleep(0.3)  # the slow joiner
    end, seq = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        for _ in range(256):
            sock.send_multipart((topic, seq.to_bytes(8, "big", signed=True), payload))
            seq += 1
    sock.close(linger=0)
    ctx.term()


def replay(port: int, seconds: float, size: int, offset: int) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.bind(f"tcp://127.0.0.1:{port}")
    payload = b"\x00" * size
    stop_at = time.monotonic() + seconds
    while time.monotonic() < stop_at:
        if not sock.poll(50):
            continue
        client, _, start = sock.recv_multipart()
        seq = int.from_bytes(start, "big", signed=True) + offset
        end = time.monotonic() + seconds
        while time.monotonic() < min(end, stop_at):
            try:
                sock.send_multipart((client, b"", b"", seq.to_bytes(8, "big", signed=True),
                                     payload), zmq.NOBLOCK)
            except zmq.Again:
                time.sleep(0.001)
                continue
            seq += 1
    sock.close(linger=0)
    ctx.term()


if __name__ == "__main__":
    mode, port, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    if mode == "flood":
        flood(port, seconds, bytes.fromhex(sys.argv[4]), bytes.fromhex(sys.argv[5]))
    else:
        replay(port, seconds, int(sys.argv[4]), int(sys.argv[5]) if len(sys.argv) > 5 else 0)
