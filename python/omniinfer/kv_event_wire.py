"""SGLang 0.5.23's KV-cache event protocol (``--kv-events-config``), for the emulator and router.

SGLang publishes what its radix cache stores and evicts so a router can follow it. On the wire
(``ZmqEventPublisher``) every batch is one ZMQ PUB message of three frames:

    topic (UTF-8) | sequence number (8 bytes, big-endian, from 0 per publisher) | payload

The payload is msgpack of ``KVEventBatch``, a positional array ``[ts, events, attn_dp_rank]``.
Each event is a map tagged by ``"type"`` (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``)
whose other keys are field names; optional fields left at ``None`` are omitted. ``BlockStored``
carries one opaque signed-int64 hash per page (``block_hashes``), the hash of the page before
the first one (``parent_block_hash``, ``None`` under the root), the pages' ``token_ids`` and the
page size (``block_size``). DP rank ``r`` publishes on the configured port + ``r``. An optional
replay ROUTER socket answers ``[b"", start_seq]`` with ``[b"", topic, seq, payload]`` per
buffered batch from ``start_seq`` on, then ``[b"", b"", -1, b""]``.

This module holds the schema (our own msgspec structs with SGLang's names and layout), a
tolerant decoder and the ``--kv-events-config`` / endpoint helpers; no sockets.
"""

from __future__ import annotations

import dataclasses
import json
import reprlib
from typing import Any

import msgspec

END_OF_REPLAY = -1  # the sequence number that ends a replay answer
GPU_MEDIA = (None, "GPU")  # device-tier events; host/disk tiers (HiCache) are not "cached"
WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]", "")


class KVEventBatch(msgspec.Struct, array_like=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    attn_dp_rank: int | None = None


class _Event(msgspec.Struct, omit_defaults=True, tag=True, gc=False):  # type: ignore[call-arg]
    pass


class BlockStored(_Event):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None


class BlockRemoved(_Event):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(_Event):
    pass


_ENCODER = msgspec.msgpack.Encoder()


def encode_batch(ts: float, events: list[Any], dp_rank: int = 0) -> bytes:
    return _ENCODER.encode(KVEventBatch(ts, events, dp_rank))


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def seq_from(frame: bytes) -> int:
    if len(frame) != 8:
        raise ProtocolError(f"sequence frame of {len(frame)} bytes, expected 8")
    return int.from_bytes(frame, "big", signed=True)


class ProtocolError(ValueError):
    """A message that does not follow the KV-event wire format."""


# ---- decoding (the router's side; unknown event types and fields are skipped) -------------
@dataclasses.dataclass(frozen=True, slots=True)
class Stored:
    hashes: tuple[int, ...]
    parent: int | None
    tokens: tuple[int, ...]
    block_size: int
    medium: str | None = None
    namespaced: bool = False  # LoRA / cache_salt blocks: a plain prompt never reuses them


@dataclasses.dataclass(frozen=True, slots=True)
class Removed:
    hashes: tuple[int, ...]
    medium: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


@dataclasses.dataclass(frozen=True, slots=True)
class Batch:
    ts: float
    events: tuple[Event, ...]
    dp_rank: int | None
    skipped: int  # events of a type this decoder does not know


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ProtocolError(f"{what} must be a list of integers")
    return tuple(value)


def _event(raw: Any) -> Event | None:
    if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
        raise ProtocolError("an event must be a map with a 'type'")
    kind = raw["type"]
    if kind == "BlockStored":
        hashes = _ints(raw.get("block_hashes"), "block_hashes")
        tokens = raw.get("token_ids")
        if isinstance(tokens, list) and tokens and isinstance(tokens[0], list):
            namespaced = True  # bigram pages (EAGLE) key on token pairs; never a plain prompt
            tokens_t: tuple[int, ...] = ()
        else:
            tokens_t = _ints(tokens, "token_ids")
            namespaced = False
        parent = raw.get("parent_block_hash")
        size = raw.get("block_size")
        if parent is not None and not isinstance(parent, int):
            raise ProtocolError("parent_block_hash must be an integer or nil")
        if not isinstance(size, int) or size <= 0:
            raise ProtocolError("block_size must be a positive integer")
        namespaced = namespaced or any(raw.get(k) is not None
                                       for k in ("lora_id", "cache_salt", "lora_name"))
        return Stored(hashes, parent, tokens_t, size, raw.get("medium"), namespaced)
    if kind == "BlockRemoved":
        return Removed(_ints(raw.get("block_hashes"), "block_hashes"), raw.get("medium"))
    if kind == "AllBlocksCleared":
        return Cleared()
    return None


# The typed schema of the events we read: msgspec validates it in C, so a well-formed batch
# costs no Python work per page. Anything else (an unknown event type, bigram pages, a field of
# the wrong type) fails it and takes the tolerant path below, which decides event by event.
class _StoredIn(msgspec.Struct, tag="BlockStored", tag_field="type", gc=False):  # type: ignore[call-arg]
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    cache_salt: str | None = None


class _RemovedIn(msgspec.Struct, tag="BlockRemoved", tag_field="type", gc=False):  # type: ignore[call-arg]
    block_hashes: list[int]
    medium: str | None = None


class _ClearedIn(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", gc=False):  # type: ignore[call-arg]
    pass


class _BatchIn(msgspec.Struct, array_like=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[_StoredIn | _RemovedIn | _ClearedIn]
    attn_dp_rank: int | None = None


_TYPED = msgspec.msgpack.Decoder(_BatchIn)


def _typed(payload: bytes) -> Batch | None:
    """The fast path: a batch of known, well-typed events; None if it is anything else."""
    try:
        raw = _TYPED.decode(payload)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    except RecursionError:  # msgspec bounds nesting depth: no schema of ours nests that deep
        raise ProtocolError("payload nested too deeply") from None
    events: list[Event] = []
    for item in raw.events:
        if type(item) is _StoredIn:
            if item.block_size <= 0:
                return None  # let the tolerant path name the error
            events.append(Stored(tuple(item.block_hashes), item.parent_block_hash,
                                 tuple(item.token_ids), item.block_size, item.medium,
                                 item.lora_id is not None or item.lora_name is not None
                                 or item.cache_salt is not None))
        elif type(item) is _RemovedIn:
            events.append(Removed(tuple(item.block_hashes), item.medium))
        else:
            events.append(Cleared())
    return Batch(raw.ts, tuple(events), raw.attn_dp_rank, 0)


def decode_batch(payload: bytes) -> Batch:
    """Decode one payload frame; ``ProtocolError`` if it is not a KVEventBatch (nesting past
    msgspec's depth bound included: never ``RecursionError``)."""
    fast = _typed(payload)
    return fast if fast is not None else _tolerant(payload)


def _tolerant(payload: bytes) -> Batch:
    """Event by event: unknown types are skipped and counted, malformed known ones refused."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"payload is not msgpack: {exc}") from None
    except RecursionError:
        raise ProtocolError("payload nested too deeply") from None
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise ProtocolError("payload must be an array [ts, events, attn_dp_rank]")
    ts = raw[0] if isinstance(raw[0], (int, float)) else 0.0
    rank = raw[2] if len(raw) > 2 and isinstance(raw[2], int) else None
    events: list[Event] = []
    skipped = 0
    for item in raw[1]:
        event = _event(item)
        if event is None:
            skipped += 1
        else:
            events.append(event)
    return Batch(float(ts), tuple(events), rank, skipped)


# ---- configuration and endpoints ------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class KvEventsConfig:
    """The fields of SGLang's ``KVEventsConfig`` that we read (others are accepted, unused)."""

    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    bind: bool | None = None  # None: bind a wildcard host, connect to a concrete one
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    topic: str = ""

    @property
    def enabled(self) -> bool:
        return self.publisher != "null"


def parse_kv_events_config(text: str | dict[str, Any]) -> KvEventsConfig:
    """``--kv-events-config`` JSON → config; ``ValueError`` with the reason if malformed."""
    if isinstance(text, dict):
        data = text
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("must be a JSON object, e.g. "
                         '{"publisher": "zmq", "endpoint": "tcp://*:5557"}')
    base = KvEventsConfig()
    values: dict[str, Any] = {}
    for field in dataclasses.fields(KvEventsConfig):
        value = data.get(field.name, getattr(base, field.name))
        if field.name in ("buffer_steps", "hwm"):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"'{field.name}' must be a positive integer")
        elif field.name == "replay_endpoint":
            if value is not None and not isinstance(value, str):
                raise ValueError("'replay_endpoint' must be a string or null")
        elif field.name == "bind":
            if value is not None and not isinstance(value, bool):
                raise ValueError("'bind' must be true, false or null")
        elif not isinstance(value, str):
            raise ValueError(f"'{field.name}' must be a string")
        values[field.name] = value
    config = KvEventsConfig(**values)
    if config.publisher not in ("null", "zmq"):
        raise ValueError(f"unknown publisher {config.publisher!r}: 'zmq' or 'null'")
    if config.enabled:
        split_tcp(config.endpoint)
        if config.replay_endpoint is not None:
            split_tcp(config.replay_endpoint)
    return config


def split_tcp(endpoint: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` → (host, port); IPv6 hosts keep their brackets."""
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"endpoint {reprlib.repr(endpoint)} is not tcp://HOST:PORT")
    host, sep, port = endpoint[len("tcp://"):].rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"endpoint {reprlib.repr(endpoint)} has no valid port")
    return host, int(port)


def offset_port(endpoint: str, rank: int) -> str:
    """The endpoint of DP rank ``rank`` (SGLang adds the rank to the port)."""
    host, port = split_tcp(endpoint)
    return f"tcp://{host}:{port + rank}"


def dial_endpoint(endpoint: str, worker_host: str) -> str:
    """Where a subscriber connects: a wildcard bind host becomes the worker's host."""
    host, port = split_tcp(endpoint)
    if host in WILDCARD_HOSTS:
        host = f"[{worker_host}]" if ":" in worker_host else worker_host
    return f"tcp://{host}:{port}"


def binds(config: KvEventsConfig) -> bool:
    """Whether the publisher binds rather than connects: ``bind``, else a wildcard host."""
    if config.bind is not None:
        return config.bind
    host, _ = split_tcp(config.endpoint)
    return host in WILDCARD_HOSTS
