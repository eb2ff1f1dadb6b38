"""SGLang 0.5.23's runtime-load feed (``--load-publish-endpoint``), for the emulator and router.

A scheduler that publishes KV events can also publish its load, so a router need not poll
``/v1/loads``. Facts of the wire, as SGLang 0.5.23 sends them:

- One ZMQ PUB socket per DP rank, bound on ``base + rank``; ``/server_info``'s ``kv_events`` block
  advertises ``load_endpoint_port_base`` and ``load_topic`` (``"load"``) beside the KV-event
  endpoint. The feed exists only together with KV events (``--kv-events-config`` with a tcp://
  endpoint). ``auto`` packs the range right after the KV-event ranks (``kv_base + dp_size``),
  past an overlapping replay range.
- Each message is three frames: topic | 8-byte big-endian sequence number (from 0 per socket) |
  msgpack payload. The payload is a tagged positional array: ``["LoadStat", running, waiting,
  used KV tokens, KV capacity, dp rank, waiting uncached tokens, total tokens, max running
  requests, cumulative prefill uncached tokens, cumulative prefill busy µs]`` — always all ten
  fields; the first four are the original format, later ones were appended.
- The scheduler publishes after every prefill batch, after every Nth decode batch
  (``--load-snapshot-publish-interval``, default 15), at most every 50 ms while work waits with
  no batch running, and when idle; a reading equal to the last one is sent again at most once a
  second (a 1 Hz heartbeat).

This module holds the message schema (our own msgspec struct with SGLang's layout), a strict
decoder, and the resolution of ``--load-publish-endpoint``; no sockets.
"""

from __future__ import annotations

import reprlib

import msgspec

from omniinfer.kv_event_wire import WILDCARD_HOSTS, KvEventsConfig, ProtocolError, split_tcp

LOAD_TOPIC = "load"
HEARTBEAT_S = 1.0  # an unchanged reading is sent again after this long
STALL_REFRESH_S = 0.05  # at most this often while work waits and no batch runs
DECODE_PUBLISH_INTERVAL = 15  # SGLang's --load-snapshot-publish-interval default
STALE_AFTER_S = 5.0  # a subscriber treats a rank silent this long as gone (5 heartbeats)


class LoadStat(msgspec.Struct, array_like=True, gc=False, tag=True):  # type: ignore[call-arg]
    """One rank's load reading, in SGLang's field order (the tag is the class name)."""

    num_running_reqs: int
    num_waiting_reqs: int
    num_tokens: int  # KV tokens in use (/v1/loads num_used_tokens)
    max_total_num_tokens: int  # KV capacity; 0 when unknown
    attn_dp_rank: int | None = None
    num_waiting_uncached_tokens: int = 0
    num_total_tokens: int = 0
    max_running_requests: int = 0
    total_prefill_uncached_tokens: int = 0
    total_prefill_busy_us: int = 0


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder()
_FIELDS = LoadStat.__struct_fields__


def encode_load(stat: LoadStat) -> bytes:
    return _ENCODER.encode(stat)


def decode_load(payload: bytes) -> LoadStat:
    """The reading in ``payload``; ``ProtocolError`` unless it is a ``LoadStat`` array with at
    least the four original fields, all integers (fields a newer SGLang appends are ignored).
    Integers are only checked non-negative: the router clamps their size
    (``omniinfer.proxy.workers.load_count``). Never ``RecursionError``."""
    try:
        raw = _DECODER.decode(payload)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"not msgpack: {exc}") from None
    except RecursionError:  # msgspec bounds nesting depth; a reading is a flat array
        raise ProtocolError("nested too deeply") from None
    if not isinstance(raw, list) or not raw or raw[0] != "LoadStat":
        raise ProtocolError("not a LoadStat array")
    values = raw[1:1 + len(_FIELDS)]
    if len(values) < 4:
        raise ProtocolError(f"{len(values)} fields, at least 4 expected")
    for name, value in zip(_FIELDS, values, strict=False):
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
        if not ok and not (name == "attn_dp_rank" and value is None):
            raise ProtocolError(f"{name} is {reprlib.repr(value)}, not a non-negative integer")
    return LoadStat(*values)


def resolve_load_endpoint(value: str | None, kv_events: KvEventsConfig | None,
                          dp_size: int = 1) -> tuple[str, int] | None:
    """``--load-publish-endpoint`` → (bind host, base port), or None when off.

    ``value``: unset or ``off`` (off), ``auto`` (after the KV-event ranks, past an overlapping
    replay range) or ``tcp://WILDCARD:PORT``. ``ValueError`` naming the reason when it cannot
    work: no KV events to advertise it through, a concrete host, an overlap, ports past 65535.
    """
    mode = (value or "").strip()
    if not mode or mode.lower() == "off":
        return None
    if kv_events is None or not kv_events.enabled:
        raise ValueError("--load-publish-endpoint needs --kv-events-config with a zmq publisher: "
                         "routers find the load feed through /server_info's kv_events block")
    kv_host, kv_base = split_tcp(kv_events.endpoint)
    replay = split_tcp(kv_events.replay_endpoint)[1] if kv_events.replay_endpoint else None
    if mode.lower() == "auto":
        if kv_host not in WILDCARD_HOSTS:
            raise ValueError("--load-publish-endpoint auto needs a wildcard-host "
                             f"--kv-events-config endpoint, got {kv_events.endpoint!r}")
        host, base = kv_host, kv_base + dp_size
        if replay is not None and base < replay + dp_size and replay < base + dp_size:
            base = replay + dp_size
    else:
        host, base = split_tcp(mode)
        if host not in WILDCARD_HOSTS:
            raise ValueError(f"--load-publish-endpoint {mode!r}: the host must be a wildcard "
                             "(*, 0.0.0.0 or ::): the feed is bound, not connected")
        for port in (kv_base, replay):
            if port is not None and base < port + dp_size and port < base + dp_size:
                raise ValueError(f"--load-publish-endpoint ports {base}..{base + dp_size - 1} "
                                 f"overlap the KV-event ports from {port}")
    if base + dp_size - 1 > 65535:
        raise ValueError(f"--load-publish-endpoint ports from {base} run past 65535")
    return host, base
