"""A hostile fake SGLang worker: admitted like an honest one, then it attacks the router.

Run by ``soak.py --hostile`` (``hostile.py``); standalone::

  python benchmark/router/hostile_worker.py --port 8100 --kv-port 8101 --replay-port 8102 \\
      --load-port 8103

Contract:

- HTTP (aiohttp): ``/health`` always answers 200 at once, so the router keeps the worker;
  ``/generate``, ``/v1/completions``, ``/v1/chat/completions`` answer a tiny fixed answer
  (``HOSTILE_TEXT``; a stream ends with ``[DONE]``), so a request the router sends here still
  gets its answer. ``/server_info`` advertises the KV-event publisher (``--kv-port``), its replay
  socket (``--replay-port``) and the load feed (``--load-port``) as SGLang 0.5.23's ``kv_events``
  block does, all on this host; with ``secrets`` it carries credentials (top level and deep in
  ``internal_states``), as do ``/model_info`` and ``/v1/models``: each secret value contains
  ``MARKER``.
- Calm (until ``POST /hostile/arm``): valid KV-event batches and load readings twice a second,
  sane control answers, a replay that ends with its end marker; the router can attach.
- Armed (``POST /hostile/arm {"attacks": [...]}``, names from ``ATTACKS``; ``POST
  /hostile/disarm`` back to calm; ``GET /hostile/stats`` what was sent): see ``ATTACKS``.
  Control routes then rotate per call between a sane answer (with its secrets) and each armed
  kind of hostile answer, so both the router's own fetches and a client's relayed ones meet
  every kind.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from typing import Any

import msgspec
import zmq
from aiohttp import web

ATTACKS = {
    "feed-flood": "load feed: valid LoadStat readings as fast as possible",
    "feed-extreme": "load feed: 1e308 floats, negative and uint64-max loads, nested msgpack",
    "loads-extreme": "GET /v1/loads: 1e308, -1e308 and 2**64 loads over 64 ranks (the feed "
                     "goes quiet, or 7 s of every 17 beside a feed attack, so that the router "
                     "polls once it is stale, 5 s on)",
    "kv-flood": "KV events: batches of 32 fresh BlockStored pages as fast as possible",
    "kv-huge-page": "KV events: one BlockStored page of 2 MiB of token ids, 4 times a second",
    "kv-resequence": "KV events: one- and two-frame messages, short sequence frames, garbage "
                     "payloads, sequence numbers jumping back and forward",
    "kv-replay-endless": "replay socket: streams entries and never sends the end marker (the "
                         "publisher skips a sequence number each second to ask for a replay)",
    "kv-nested": "KV events: 100k-deep nested msgpack payloads",
    "control-endless": "/v1/models, /model_info, /server_info, /health_generate, /v1/loads: "
                       "a body that never ends",
    "control-huge": "the same routes: one complete JSON body of --huge-mib MiB",
    "secrets": "credentials in /server_info (deep in internal_states), /model_info, /v1/models",
}
MARKER = "HOSTILE-SECRET"
HOSTILE_TEXT = "hostile-answer"
BLOCK_SIZE = 16
FLOOD_EVENTS = 32
FEED_ON_S, FEED_OFF_S = 10.0, 7.0
CONTROL_PATHS = ("/v1/models", "/model_info", "/server_info", "/health_generate", "/v1/loads")
MODEL = "SmolLM2-135M-Instruct"
_ENC = msgspec.msgpack.Encoder()


def secret(name: str) -> str:
    return f"{MARKER}-{name}"


def deep_secrets(depth: int = 24) -> dict[str, Any]:
    """A chain ``depth`` maps deep ending in a private key."""
    node: dict[str, Any] = {"private_key": secret("deep-private-key")}
    for i in range(depth):
        node = {f"level{i}": node}
    return node


def server_info(port: int, kv: int, replay: int, load: int, secrets: bool) -> dict[str, Any]:
    """What ``GET /server_info`` answers: enough of SGLang 0.5.23's shape to be followed."""
    info: dict[str, Any] = {
        "model_path": MODEL, "served_model_name": MODEL, "tokenizer_path": MODEL, "port": port,
        "host": "127.0.0.1", "page_size": BLOCK_SIZE, "dp_size": 1, "max_total_num_tokens": 16384,
        "max_running_requests": 256, "context_length": 8192, "disaggregation_mode": "null",
        "version": "0.5.23", "load_publish_endpoint": f"tcp://*:{load}",
        "kv_events_config": msgspec.json.encode({"publisher": "zmq", "endpoint": f"tcp://*:{kv}",
                                                 "replay_endpoint": f"tcp://*:{replay}"}).decode(),
        "kv_events": {"publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": kv,
                      "topic": "", "block_size": BLOCK_SIZE, "dp_size": 1,
                      "replay_endpoint_port_base": replay, "load_endpoint_port_base": load,
                      "load_topic": "load"},
        "internal_states": [{"last_gen_throughput": 0.0}],
    }
    if secrets:
        info.update({"api_key": secret("api_key"), "admin_api_key": secret("admin_api_key"),
                     "ssl_keyfile_password": secret("ssl"), "watermark_key": secret("watermark"),
                     "hf_token": secret("hf_token")})
        info["internal_states"][0].update({
            "api_key": secret("internal-api-key"),
            "backends": [{"db_password": secret("db"), "session_token": secret("session"),
                          "clientSecret": secret("client")}],
            "vault": deep_secrets()})
    return info


def model_info(secrets: bool) -> dict[str, Any]:
    info: dict[str, Any] = {"model_path": MODEL, "tokenizer_path": MODEL, "is_generation": True,
                            "served_model_name": MODEL, "model_type": "llama"}
    if secrets:
        info.update({"hf_token": secret("model-hf-token"),
                     "extra": {"loader": [{"api_key": secret("model-loader-key")}]}})
    return info


def models(secrets: bool) -> dict[str, Any]:
    entry: dict[str, Any] = {"id": MODEL, "object": "model", "owned_by": "sglang",
                             "max_model_len": 8192}
    if secrets:
        entry.update({"api_key": secret("models-key"),
                      "permission": [{"access_token": secret("models-access-token")}]})
    return {"object": "list", "data": [entry]}


def loads(extreme: bool) -> dict[str, Any]:
    """``/v1/loads``: one idle rank, or 64 ranks of impossible figures."""
    rank: dict[str, Any] = {"dp_rank": 0, "num_running_reqs": 0, "num_waiting_reqs": 0,
                            "num_waiting_uncached_tokens": 0, "num_used_tokens": 0,
                            "max_total_num_tokens": 16384, "max_running_requests": 256,
                            "token_usage": 0.0, "gen_throughput": 0.0,
                            "total_prefill_uncached_tokens": 0, "total_prefill_busy_us": 0}
    if not extreme:
        return {"version": "0.5.23", "loads": [rank]}
    values = (1e308, -1e308, 2 ** 64 - 1, -1, 1e308)
    ranks = [{**{k: values[(i + j) % len(values)] for j, k in enumerate(rank)}, "dp_rank": i}
             for i in range(64)]
    return {"version": "0.5.23", "loads": ranks}


def load_stat(values: list[Any]) -> bytes:
    """A load-feed payload: SGLang's tagged positional ``LoadStat`` array."""
    return _ENC.encode(["LoadStat", *values])


def kv_batch(events: list[dict[str, Any]]) -> bytes:
    """A KV-event payload: ``[ts, events, attn_dp_rank]``."""
    return _ENC.encode([time.time(), events, 0])


def stored(first_hash: int, pages: int, parent: int | None, tokens: list[int],
           block_size: int = BLOCK_SIZE) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": list(range(first_hash, first_hash + pages)),
            "parent_block_hash": parent, "token_ids": tokens, "block_size": block_size}


def nested(depth: int = 100_000, kv: bool = True) -> bytes:
    """msgpack nested ``depth`` arrays deep (inside a batch's events for KV)."""
    inner = b"\x91" * depth + b"\x90"
    return (b"\x93\xcb" + b"\x00" * 8 + inner + b"\x00") if kv else inner


HUGE_PAGE_TOKENS = 700_000  # 3 bytes each in msgpack: ~2 MiB
_HUGE_TOKENS = [1000 + i % 60_000 for i in range(HUGE_PAGE_TOKENS)]


class State:
    """What the threads and handlers share: the armed attacks, counters, a stop flag."""

    def __init__(self) -> None:
        self.attacks: frozenset[str] = frozenset()
        self.stats: dict[str, int] = {}
        self.stop = threading.Event()
        self.hits: dict[str, int] = {}
        self.armed_at = time.monotonic()

    def on(self, attack: str) -> bool:
        return attack in self.attacks

    def add(self, key: str, n: int = 1) -> None:
        self.stats[key] = self.stats.get(key, 0) + n


def seq8(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def bound_socket(ctx: zmq.Context[Any], kind: int, port: int, option: int,
                 value: int) -> zmq.Socket[Any]:
    """A ``kind`` socket with ``option`` set to ``value`` and no linger, bound to ``port`` on
    127.0.0.1."""
    sock = ctx.socket(kind)
    sock.setsockopt(option, value)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"tcp://127.0.0.1:{port}")
    return sock


def kv_publisher(ctx: zmq.Context[Any], port: int, state: State) -> None:
    """The KV-event PUB socket: calm batches, or the armed KV attacks interleaved."""
    sock = bound_socket(ctx, zmq.PUB, port, zmq.SNDHWM, 100_000)
    seq, next_hash, parent = 0, 1 << 40, None
    tokens = [100 + i for i in range(BLOCK_SIZE)]
    flood_tokens = tokens * FLOOD_EVENTS
    due = {"huge": 0.0, "nested": 0.0, "reseq": 0.0, "gap": 0.0, "calm": 0.0}
    trick = 0

    def send(frames: list[bytes], key: str) -> None:
        try:
            sock.send_multipart(frames, flags=zmq.NOBLOCK)
            state.add(key)
        except zmq.Again:
            state.add("kv_dropped_hwm")

    while not state.stop.is_set():
        now = time.monotonic()
        if not state.on("kv-flood") and now >= due["calm"]:  # the heartbeat of an idle cache
            due["calm"] = now + 0.2
            send([b"", seq8(seq), kv_batch([stored(next_hash, 1, None, tokens)])], "kv_calm")
            seq, next_hash = seq + 1, next_hash + 1
        if not state.attacks & {a for a in ATTACKS if a.startswith("kv-")}:
            time.sleep(0.02)
            continue
        busy = False
        if state.on("kv-huge-page") and now >= due["huge"]:
            due["huge"] = now + 0.25
            size = BLOCK_SIZE if trick % 2 else HUGE_PAGE_TOKENS  # page size lies, or is huge
            send([b"", seq8(seq), kv_batch([stored(next_hash, 1, None, _HUGE_TOKENS, size)])],
                 "kv-huge-page")
            seq, next_hash, trick = seq + 1, next_hash + 1, trick + 1
        if state.on("kv-nested") and now >= due["nested"]:
            due["nested"] = now + 0.25
            send([b"", seq8(seq), nested()], "kv-nested")
            seq += 1
        if state.on("kv-replay-endless") and now >= due["gap"]:
            due["gap"] = now + 1.0
            seq += 10  # a gap: the router asks the replay socket for it
            state.add("kv-replay-endless_gaps")
        if state.on("kv-resequence") and now >= due["reseq"]:
            due["reseq"] = now + 0.05
            kinds: list[tuple[list[bytes], int]] = [
                ([kv_batch([])], 0), ([b"", seq8(seq)], 0), ([b"", b"\x01\x02\x03", b"\x90"], 0),
                ([b"", seq8(seq), b"\xc1\xc1"], 1), ([b"", seq8(seq), _ENC.encode(7)], 1),
                ([b"", seq8(max(0, seq - 1000)), kv_batch([])], 0),
                ([b"", seq8(seq + 5000), kv_batch([])], 5001), ([b"", seq8(-5), kv_batch([])], 0),
                ([b"", seq8(seq), kv_batch([]), b"extra"], 0)]
            frames, advance = kinds[trick % len(kinds)]
            send(frames, "kv-resequence")
            seq, trick = seq + advance, trick + 1
        if state.on("kv-flood"):
            send([b"", seq8(seq), kv_batch([stored(next_hash + i, 1, parent, tokens)
                                            for i in range(FLOOD_EVENTS)])
                  if trick % 2 else kv_batch([stored(next_hash, FLOOD_EVENTS, parent,
                                                     flood_tokens)])], "kv-flood")
            parent = next_hash + FLOOD_EVENTS - 1
            seq, next_hash, trick, busy = seq + 1, next_hash + FLOOD_EVENTS, trick + 1, True
        if not busy:
            time.sleep(0.005)
    sock.close(linger=0)


def replay_server(ctx: zmq.Context[Any], port: int, state: State) -> None:
    """The replay ROUTER socket: ends each answer (calm) or streams it forever (armed)."""
    sock = bound_socket(ctx, zmq.ROUTER, port, zmq.ROUTER_MANDATORY, 1)
    active: dict[bytes, int] = {}  # peer -> next sequence number it gets
    tokens = [100 + i for i in range(BLOCK_SIZE)]
    while not state.stop.is_set():
        while sock.poll(0 if active else 20):
            frames = sock.recv_multipart()
            state.add("replay_requests")
            if len(frames) < 3 or len(frames[2]) != 8:
                continue
            start = int.from_bytes(frames[2], "big", signed=True)
            if state.on("kv-replay-endless") and len(active) < 64:
                active[frames[0]] = max(0, start)
            else:
                try:
                    sock.send_multipart([frames[0], b"", b"", seq8(-1), b""], flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        if not state.on("kv-replay-endless"):
            active.clear()
        for peer in list(active):
            for _ in range(64):
                seq = active[peer]
                payload = kv_batch([stored((1 << 41) + seq * 4, 4, None, tokens * 4)])
                try:
                    sock.send_multipart([peer, b"", b"", seq8(seq), payload], flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                except zmq.ZMQError:  # the peer left (EHOSTUNREACH)
                    active.pop(peer, None)
                    break
                active[peer] = seq + 1
                state.add("kv-replay-endless")
        if active:
            time.sleep(0.001)
    sock.close(linger=0)


def load_publisher(ctx: zmq.Context[Any], port: int, state: State) -> None:
    """The load-feed PUB socket: an idle heartbeat (calm), or the armed feed attacks."""
    sock = bound_socket(ctx, zmq.PUB, port, zmq.SNDHWM, 100_000)
    seq, n, due = 0, 0, 0.0
    idle = [0, 0, 0, 16384, 0, 0, 0, 256, 0, 0]
    u64 = 2 ** 64 - 1
    extremes = [load_stat([1e308] * 10), load_stat([-1] * 4 + [0] * 6),
                load_stat([u64] * 4 + [0, u64, u64, u64, u64, u64]), load_stat([u64, 0, u64, 1]),
                nested(kv=False), b"\xc1"]
    while not state.stop.is_set():
        now = time.monotonic()
        feed_attacks = state.on("feed-flood") or state.on("feed-extreme")
        quiet = state.on("loads-extreme") and (  # silent: the router polls /v1/loads
            not feed_attacks or (now - state.armed_at) % (FEED_ON_S + FEED_OFF_S) >= FEED_ON_S)
        if quiet:
            time.sleep(0.05)
            continue
        if not feed_attacks:
            if now >= due:
                due = now + 0.5
                sock.send_multipart([b"load", seq8(seq), load_stat(idle)])
                seq += 1
            time.sleep(0.02)
            continue
        n += 1
        if state.on("feed-extreme") and (n % 10 == 0 or not state.on("feed-flood")):
            payload, key = extremes[n % len(extremes)], "feed-extreme"
        else:
            payload, key = load_stat([n % 7, n % 3, n % 9000, 16384, 0, 0, n % 9000, 256,
                                      n, n * 10]), "feed-flood"
        try:
            sock.send_multipart([b"load", seq8(seq), payload], flags=zmq.NOBLOCK)
            state.add(key)
        except zmq.Again:
            state.add("feed_dropped_hwm")
        seq += 1
        if not state.on("feed-flood"):
            time.sleep(0.01)
    sock.close(linger=0)


class HostileServer:
    """The HTTP side: admitted as a worker, answers inference, rotates hostile control answers."""

    def __init__(self, args: argparse.Namespace, state: State) -> None:
        self.args, self.state = args, state

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        r = app.router
        r.add_get("/health", self.health)
        for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
            r.add_post(path, self.generate)
        for path in CONTROL_PATHS + ("/get_model_info", "/get_server_info"):
            r.add_get(path, self.control)
        r.add_post("/abort_request", self.health)
        r.add_route("*", "/flush_cache", self.health)
        r.add_post("/hostile/arm", self.arm)
        r.add_post("/hostile/disarm", self.disarm)
        r.add_get("/hostile/stats", self.stats)
        return app

    async def health(self, _req: web.Request) -> web.Response:
        return web.Response(status=200)

    async def generate(self, req: web.Request) -> web.StreamResponse:
        self.state.add("generate")
        try:
            body = await req.json()
        except ValueError:
            body = {}
        meta = {"id": "hostile", "finish_reason": {"type": "length", "length": 1},
                "prompt_tokens": 1, "completion_tokens": 1, "cached_tokens": 0}
        if req.path == "/generate":
            answer: dict[str, Any] = {"text": HOSTILE_TEXT, "output_ids": [1], "meta_info": meta}
        else:
            choice = ({"index": 0, "message": {"role": "assistant", "content": HOSTILE_TEXT}}
                      if "chat" in req.path else {"index": 0, "text": HOSTILE_TEXT})
            answer = {"id": "hostile", "object": "completion", "model": MODEL,
                      "choices": [{**choice, "finish_reason": "length"}],
                      "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
        if not (isinstance(body, dict) and body.get("stream")):
            return web.json_response(answer)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(req)
        await resp.write(b"data: " + msgspec.json.encode(answer) + b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def _sane(self, path: str) -> Any:
        secrets = self.state.on("secrets")
        a = self.args
        if path.endswith("server_info"):
            return server_info(a.port, a.kv_port, a.replay_port, a.load_port, secrets)
        if path.endswith("model_info"):
            return model_info(secrets)
        if path == "/v1/models":
            return models(secrets)
        if path == "/v1/loads":
            return loads(False)
        return None  # /health_generate: an empty 200

    async def control(self, req: web.Request) -> web.StreamResponse:
        path = req.path
        modes = ["sane"] + [m for m in ("control-endless", "control-huge")
                            if self.state.on(m)]
        if path == "/v1/loads" and self.state.on("loads-extreme"):
            modes.append("loads-extreme")
        hit = self.state.hits[path] = self.state.hits.get(path, 0) + 1
        mode = modes[hit % len(modes)]
        self.state.add(f"{mode} {path}")
        if mode == "loads-extreme":
            return web.Response(body=msgspec.json.encode(loads(True)),
                                content_type="application/json")
        if mode == "sane":
            body = self._sane(path)
            return web.Response(status=200) if body is None else web.json_response(body)
        head, chunk, tail = b'{"data": [', b'"' + b"x" * ((1 << 20) - 3) + b'",', b'"x"]}'
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        total = None
        if mode == "control-huge":
            total = self.args.huge_mib
            resp.content_length = len(head) + total * len(chunk) + len(tail)
        await resp.prepare(req)
        await resp.write(head)
        sent, began = 0, time.monotonic()
        try:
            while (total is None and self.state.on("control-endless")) or \
                    (total is not None and sent < total):
                await resp.write(chunk)
                sent += 1
                if total is None:  # endless: paced at --endless-mib-s
                    ahead = sent / self.args.endless_mib_s - (time.monotonic() - began)
                    if ahead > 0:
                        await asyncio.sleep(ahead)
            await resp.write(tail)
            await resp.write_eof()
        except (ConnectionError, RuntimeError):
            pass  # the router gave up reading: the point
        finally:
            self.state.add(f"{mode}_mib", sent)
        return resp

    async def arm(self, req: web.Request) -> web.Response:
        body = await req.json()
        wanted = body.get("attacks", list(ATTACKS)) if isinstance(body, dict) else []
        unknown = sorted(set(wanted) - set(ATTACKS))
        if unknown:
            return web.json_response({"error": f"unknown attacks {unknown}"}, status=400)
        self.state.attacks = frozenset(wanted) | (self.state.attacks & {"secrets"})
        self.state.armed_at = time.monotonic()
        return web.json_response({"armed": sorted(self.state.attacks)})

    async def disarm(self, _req: web.Request) -> web.Response:
        self.state.attacks &= {"secrets"}
        return web.json_response({"armed": sorted(self.state.attacks)})

    async def stats(self, _req: web.Request) -> web.Response:
        return web.json_response({"armed": sorted(self.state.attacks),
                                  "sent": dict(sorted(self.state.stats.items()))})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--kv-port", type=int, required=True)
    ap.add_argument("--replay-port", type=int, required=True)
    ap.add_argument("--load-port", type=int, required=True)
    ap.add_argument("--huge-mib", type=int, default=256, help="size of a control-huge body")
    ap.add_argument("--endless-mib-s", type=float, default=32.0,
                    help="pace of a control-endless body")
    ap.add_argument("--no-secrets", action="store_true", help="calm answers carry no secrets")
    args = ap.parse_args()
    state = State()
    if not args.no_secrets:
        state.attacks = frozenset({"secrets"})
    ctx: zmq.Context[Any] = zmq.Context()
    for target, port in ((kv_publisher, args.kv_port), (replay_server, args.replay_port),
                         (load_publisher, args.load_port)):
        threading.Thread(target=target, args=(ctx, port, state), daemon=True).start()
    try:
        web.run_app(HostileServer(args, state).app(), host="127.0.0.1", port=args.port,
                    print=None, access_log=None)
    finally:
        state.stop.set()


if __name__ == "__main__":
    main()
