"""The HTTP face of an emulated worker: SGLang 0.5.23's endpoints over aiohttp + uvloop.

PD pairing across processes (our design; SGLang's real bootstrap server speaks its own protocol):
a ``prefill`` emulator also serves a small *bootstrap endpoint* on its
``--disaggregation-bootstrap-port``:

    GET /emulator/kv/{room}?wait=S&bandwidth_gb_s=B

It long-polls up to S seconds for the prefill of ``room`` to finish (404 ``{"status":
"pending"}`` when it has not), then answers ``{"room", "prompt_tokens", "cached_tokens",
"first_token", "transfer_s"}``, where ``transfer_s`` is the prefill's transfer model with the
bandwidth capped at the decode side's B, and frees the held KV ``transfer_s`` later. A
``decode`` emulator receiving a request with ``bootstrap_host/port/room`` polls that endpoint
(repeating until ``bootstrap_timeout_s``), waits for KV room, sleeps ``transfer_s``, emits the
prefill's first token and decodes the rest. Health probes that use SGLang's fake bootstrap host
(2.2.2.2) skip the pairing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from omniinfer.emulator import protocol as proto
from omniinfer.emulator.engine import EmulatedEngine, EmuRequest
from omniinfer.emulator.kv_events import ZmqKvEventPublisher, server_info_block
from omniinfer.emulator.profile import Profile
from omniinfer.emulator.protocol import BadRequest, validation_error
from omniinfer.kv_events import parse_kv_events_config

logger = logging.getLogger("omniinfer.emulator")
FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # sglang.srt.disaggregation.utils.FAKE_BOOTSTRAP_HOST
SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}


def _dumps(obj: Any) -> bytes:
    return orjson.dumps(obj)


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=_dumps(obj), status=status, content_type="application/json")


class WorkerServer:
    """One emulated SGLang worker (engine + HTTP routes + optional PD bootstrap endpoint)."""

    def __init__(
        self,
        profile: Profile,
        port: int,
        host: str = "127.0.0.1",
        mode: str = "null",
        bootstrap_port: int = 8998,
        time_scale: float = 1.0,
        incremental_streaming_output: bool = False,
        kv_events_config: str | None = None,
    ) -> None:
        self.profile = profile
        self.port = port
        self.host = host
        self.mode = mode
        self.bootstrap_port = bootstrap_port
        self.time_scale = time_scale
        self.incremental = incremental_streaming_output
        self.engine = EmulatedEngine(profile, mode=mode, time_scale=time_scale)
        self.tokenizer = self.engine.tokenizer
        self.model_name = profile.model.served_model_name
        self.start_ts = time.time()
        self.http_requests_total = 0
        self.bootstrapping = 0  # decode mode: requests polling their prefill
        self._client: aiohttp.ClientSession | None = None
        self._runners: list[web.AppRunner] = []
        # SGLang's --kv-events-config (raw JSON, as /server_info reports it); ValueError if bad
        self.kv_events_raw = kv_events_config
        self.kv_events = parse_kv_events_config(kv_events_config) if kv_events_config else None
        self.kv_publisher: ZmqKvEventPublisher | None = None

    # -- app ----------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[self._errors])
        r = app.router
        r.add_route("POST", "/generate", self.generate)
        r.add_route("PUT", "/generate", self.generate)
        r.add_post("/v1/completions", self.completions)
        r.add_post("/v1/chat/completions", self.chat)
        for path in ("/health", "/health_generate", "/ready"):
            r.add_get(path, self.health)
        r.add_get("/model_info", self.model_info)
        r.add_get("/get_model_info", self.model_info)
        r.add_get("/server_info", self.server_info)
        r.add_get("/get_server_info", self.server_info)
        r.add_get("/v1/loads", self.loads)
        r.add_get("/v1/models", self.models)
        r.add_get("/metrics", self.metrics)
        r.add_route("GET", "/flush_cache", self.flush_cache)
        r.add_route("POST", "/flush_cache", self.flush_cache)
        r.add_post("/abort_request", self.abort_request)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    def bootstrap_app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/emulator/kv/{room}", self.kv_pull)
        app.router.add_get("/health", self.health)
        return app

    async def _on_startup(self, _app: web.Application) -> None:
        if self.kv_events is not None and self.kv_events.enabled:
            self.kv_publisher = ZmqKvEventPublisher(self.kv_events)
            self.kv_publisher.start()
            if self.engine.tree is not None:
                self.engine.tree.attach_events(self.kv_publisher.recorder)
        self.engine.start()
        if self.mode == "decode":
            self._client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))

    async def _on_cleanup(self, _app: web.Application) -> None:
        await self.engine.stop()
        if self.kv_publisher is not None:
            await self.kv_publisher.close()
        if self._client is not None:
            await self._client.close()

    async def start(self) -> None:
        """Serve (and the bootstrap endpoint in prefill mode) until cancelled."""
        runner = web.AppRunner(self.app(), access_log=None, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, self.host, self.port, backlog=4096).start()
        self._runners.append(runner)
        if self.mode == "prefill":
            boot = web.AppRunner(self.bootstrap_app(), access_log=None)
            await boot.setup()
            await web.TCPSite(boot, self.host, self.bootstrap_port, backlog=4096).start()
            self._runners.append(boot)

    async def close(self) -> None:
        for runner in reversed(self._runners):
            await runner.cleanup()
        self._runners.clear()

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        self.http_requests_total += 1
        try:
            return await handler(request)
        except BadRequest as exc:
            return _json(exc.body, exc.status)
        except web.HTTPException:
            raise
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception as exc:  # a bug in the emulator: say so, keep serving
            logger.exception("internal error on %s", request.path)
            return _json({"error": {"message": f"emulator internal error: {type(exc).__name__}: {exc}"}}, 500)

    # -- helpers ------------------------------------------------------------------------------
    @staticmethod
    async def _body(request: web.Request) -> Any:
        """The JSON body; like SGLang, only with Content-Type application/json."""
        media = request.headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
        if media != "application/json":
            raise validation_error("Unsupported Media Type: Only 'application/json' is allowed")
        raw = await request.read()
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise validation_error(f"JSON decode error: {exc}") from None

    async def _overhead(self) -> None:
        delay = self.profile.cost.request_overhead_s * self.time_scale
        if delay > 0:
            await asyncio.sleep(delay)

    async def _start_request(self, ids: list[int], max_new: int, pd: proto.ParsedGenerate,
                             rid: str | None = None) -> EmuRequest:
        room = None if pd.bootstrap_host == FAKE_BOOTSTRAP_HOST else pd.bootstrap_room
        request = EmuRequest(ids, max_new, bootstrap_room=room)
        if rid:
            request.rid = rid
        request.received_ts = time.time()
        await self._overhead()
        if self.mode == "decode":
            if pd.bootstrap_room is None or pd.bootstrap_host is None:
                raise BadRequest("a decode worker needs bootstrap_host, bootstrap_port and bootstrap_room")
            if pd.bootstrap_host != FAKE_BOOTSTRAP_HOST:
                await self._pull_kv(request, pd)
            try:
                return self.engine.submit_transferred(request)
            except ValueError as exc:
                raise BadRequest(str(exc)) from None
        try:
            return self.engine.submit(request)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None

    async def _pull_kv(self, request: EmuRequest, pd: proto.ParsedGenerate) -> None:
        """Decode mode: wait for the paired prefill's KV (see the module docstring)."""
        assert self._client is not None
        port = pd.bootstrap_port or 8998
        url = f"http://{pd.bootstrap_host}:{port}/emulator/kv/{pd.bootstrap_room}"
        deadline = time.monotonic() + self.profile.transfer.bootstrap_timeout_s
        params = {"wait": "10", "bandwidth_gb_s": str(self.profile.transfer.bandwidth_gb_s)}
        last_error = "no answer"
        self.bootstrapping += 1
        try:
            while time.monotonic() < deadline:
                try:
                    async with self._client.get(url, params=params) as response:
                        if response.status == 200:
                            info = await response.json()
                            request.first_token = int(info["first_token"])
                            request.transfer_s = float(info["transfer_s"])
                            request.cached_tokens = int(info.get("cached_tokens", 0))
                            return
                        last_error = f"HTTP {response.status}"
                except (aiohttp.ClientError, OSError) as exc:
                    last_error = f"{type(exc).__name__}: {exc}"
                    await asyncio.sleep(0.05)
        finally:
            self.bootstrapping -= 1
        raise BadRequest(
            f"KV transfer failed: prefill bootstrap {pd.bootstrap_host}:{port} room "
            f"{pd.bootstrap_room}: {last_error}", status=503,
        )

    async def _progress(self, request: EmuRequest) -> AsyncIterator[int]:
        """Yields the number of output tokens each time the request makes progress."""
        seen = 0
        while True:
            if len(request.output_ids) > seen:
                seen = len(request.output_ids)
                yield seen
            if request.finished:
                return
            await request.wait_progress()

    async def _wait(self, request: EmuRequest) -> None:
        while not request.finished:
            await request.wait_progress()

    def _abort_if_running(self, request: EmuRequest) -> None:
        if not request.finished:
            self.engine.abort(request.rid)

    # -- PD bootstrap -------------------------------------------------------------------------
    async def kv_pull(self, http: web.Request) -> web.Response:
        try:
            room = int(http.match_info["room"])
            wait = min(float(http.query.get("wait", "10")), 60.0)
            peer_bw = float(http.query.get("bandwidth_gb_s", "inf"))
        except ValueError:
            return _json({"error": "room must be an integer, wait and bandwidth_gb_s numbers"}, 400)
        request = await self.engine.wait_room(room, wait)
        if request is None:
            return _json({"status": "pending", "room": room}, 404)
        tokens = request.prompt_tokens
        cost = self.engine.cost
        transfer_s = cost.transfer_time(tokens)
        own_bw = self.profile.transfer.bandwidth_gb_s
        if peer_bw < own_bw:  # the slower end bounds the transfer
            transfer_s = self.profile.transfer.latency_s + (transfer_s - self.profile.transfer.latency_s) * own_bw / peer_bw
        self.engine.kv_fetched(room, transfer_s)
        return _json({
            "room": room, "prompt_tokens": tokens, "cached_tokens": request.cached_tokens,
            "first_token": request.output_ids[0] if request.output_ids else 0,
            "transfer_s": transfer_s,
        })

    # -- /generate ----------------------------------------------------------------------------
    async def generate(self, http: web.Request) -> web.StreamResponse:
        body = await self._body(http)
        parsed = proto.parse_generate(body, self.tokenizer)
        dispatch_ts = time.time()
        if parsed.batched:
            requests = [
                await self._start_request(ids, parsed.max_new_tokens, parsed, parsed.rid[i] if parsed.rid else None)
                for i, ids in enumerate(parsed.prompts)
            ]
            try:
                await asyncio.gather(*(self._wait(r) for r in requests))
            finally:
                for r in requests:
                    self._abort_if_running(r)
            return _json([proto.generate_body(r, self.tokenizer, True, dispatch_ts) for r in requests])
        request = await self._start_request(parsed.prompts[0], parsed.max_new_tokens, parsed,
                                            parsed.rid[0] if parsed.rid else None)
        if not parsed.stream:
            try:
                await self._wait(request)
            finally:
                self._abort_if_running(request)
            if request.error:
                return _json({"error": {"message": request.error}}, 503)
            return _json(proto.generate_body(request, self.tokenizer, True, dispatch_ts))
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(http)
        sent = 0
        try:
            async for count in self._progress(request):
                final = request.finished and count == len(request.output_ids)
                start = sent if self.incremental else 0
                chunk = proto.generate_body(request, self.tokenizer, final, dispatch_ts, count, start)
                await response.write(b"data: " + _dumps(chunk) + b"\n\n")
                sent = count
            if request.error:
                error = {"error": {"message": request.error, "type": "invalid_request_error",
                                   "code": 503, "retryable": True}}
                await response.write(b"data: " + _dumps(error) + b"\n\n")
            elif sent == 0 or not request.output_ids:
                chunk = proto.generate_body(request, self.tokenizer, True, dispatch_ts)
                await response.write(b"data: " + _dumps(chunk) + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
        finally:
            self._abort_if_running(request)
        return response

    # -- OpenAI -------------------------------------------------------------------------------
    async def completions(self, http: web.Request) -> web.StreamResponse:
        return await self._openai(http, chat=False)

    async def chat(self, http: web.Request) -> web.StreamResponse:
        return await self._openai(http, chat=True)

    async def _openai(self, http: web.Request, chat: bool) -> web.StreamResponse:
        body = await self._body(http)
        ids, max_tokens, stream, include_usage, pd = proto.parse_openai(
            body, chat, self.tokenizer, self.profile.model.default_system_prompt
        )
        model = body.get("model") if isinstance(body.get("model"), str) else self.model_name
        rid, created = proto.new_id(), int(time.time())
        request = await self._start_request(ids, max_tokens, pd, body.get("rid") if isinstance(body.get("rid"), str) else None)
        if not stream:
            try:
                await self._wait(request)
            finally:
                self._abort_if_running(request)
            if request.error:
                return _json({"object": "error", "message": request.error, "type": "Service Unavailable",
                              "param": None, "code": 503}, 503)
            text = self.tokenizer.decode(request.output_ids)
            build = proto.chat_body if chat else proto.completion_body
            return _json(build(request, text, model, rid, created))
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(http)
        obj = "chat.completion.chunk" if chat else "text_completion"
        try:
            if chat:
                first = proto.chat_chunk({"reasoning_content": None, "role": "assistant", "content": ""},
                                         None, model, rid, created)
                await response.write(b"data: " + _dumps(first) + b"\n\n")
            sent = 0
            async for count in self._progress(request):
                text = self.tokenizer.decode(request.output_ids[sent:count])
                sent = count
                last = request.finished and count == len(request.output_ids)
                if chat:
                    chunk = proto.chat_chunk({"reasoning_content": None, "content": text}, None, model, rid, created)
                else:
                    chunk = proto.completion_chunk(text, proto.finish_reason_name(request) if last else None,
                                                   model, rid, created)
                await response.write(b"data: " + _dumps(chunk) + b"\n\n")
            if request.error:
                error = {"object": "error", "message": request.error, "type": "Service Unavailable",
                         "param": None, "code": 503}
                await response.write(b"data: " + _dumps({"error": error}) + b"\n\n")
            elif chat:
                end = proto.chat_chunk({"reasoning_content": None}, proto.finish_reason_name(request),
                                       model, rid, created)
                await response.write(b"data: " + _dumps(end) + b"\n\n")
            if include_usage and not request.error:
                await response.write(b"data: " + _dumps(proto.usage_chunk(request, obj, model, rid, created)) + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
        finally:
            self._abort_if_running(request)
        return response

    # -- control and status -------------------------------------------------------------------
    async def health(self, _http: web.Request) -> web.Response:
        return web.Response(status=200)

    async def abort_request(self, http: web.Request) -> web.Response:
        body = await self._body(http)
        if not isinstance(body, dict):
            raise validation_error("Input should be a valid dictionary or object to extract fields from")
        rid = body.get("rid", "")
        abort_all = body.get("abort_all", False)
        if not isinstance(rid, str) or not isinstance(abort_all, bool):
            raise validation_error("rid must be a string and abort_all a boolean")
        self.engine.abort(rid, abort_all=abort_all)
        return web.Response(status=200)

    async def flush_cache(self, _http: web.Request) -> web.Response:
        if self.engine.flush_cache():
            return web.Response(text=(
                "Cache flushed.\nPlease check backend logs for more details. "
                "(When there are running or waiting requests, the operation will not be performed.)\n"
            ))
        return web.Response(text="Cache not flushed: there are running or waiting requests.\n", status=400)

    async def model_info(self, _http: web.Request) -> web.Response:
        m = self.profile.model
        return _json({
            "model_path": m.model_path, "served_model_name": m.served_model_name,
            "tokenizer_path": m.model_path, "is_generation": True, "preferred_sampling_params": None,
            "weight_version": "default", "load_format": "auto", "reasoning_parser": None,
            "tool_call_parser": None, "disaggregation_mode": self.mode,
            "has_image_understanding": False, "has_audio_understanding": False,
            "model_type": m.model_type, "architectures": list(m.architectures),
        })

    async def models(self, _http: web.Request) -> web.Response:
        m = self.profile.model
        return _json({"object": "list", "data": [{
            "id": m.served_model_name, "object": "model", "created": int(self.start_ts),
            "owned_by": "sglang", "root": m.model_path, "parent": None, "max_model_len": m.context_length,
        }]})

    def _server_args(self) -> dict[str, Any]:
        template = json.loads(
            resources.files("omniinfer.emulator").joinpath("sglang_0.5.23_server_info.json").read_text("utf-8")
        )
        cap, m = self.profile.capacity, self.profile.model
        template.update({
            "model_path": m.model_path, "tokenizer_path": m.model_path, "served_model_name": m.served_model_name,
            "host": self.host, "port": self.port, "device": "emulated",
            "max_total_tokens": cap.max_total_tokens, "max_total_num_tokens": cap.max_total_tokens,
            "chunked_prefill_size": cap.chunked_prefill_size, "max_prefill_tokens": cap.max_prefill_tokens,
            "max_running_requests": cap.max_running_requests, "context_length": m.context_length,
            "max_req_input_len": m.context_length - 6, "disable_radix_cache": not cap.radix_cache,
            "disaggregation_mode": self.mode, "disaggregation_bootstrap_port": self.bootstrap_port,
            "disaggregation_transfer_backend": "emulated",
            "disaggregation_decode_enable_radix_cache": cap.decode_radix_cache,
            "launch_command": f"omniinfer emulate-worker --profile {self.profile.name} --port {self.port} "
                              f"--disaggregation-mode {self.mode} --time-scale {self.time_scale}",
            "emulated": True, "emulator_profile": self.profile.name, "emulator_time_scale": self.time_scale,
            "kv_events_config": self.kv_events_raw, "kv_events": server_info_block(self.kv_events),
        })
        return template

    async def server_info(self, _http: web.Request) -> web.Response:
        info = self._server_args()
        internal = {k: v for k, v in info.items() if k not in ("internal_states", "version", "frontend",
                                                                "launch_command", "status")}
        internal.update({
            "memory_usage": {"weight": 0.0, "kvcache": 0.0, "startup_available": 0.0,
                             "token_capacity": self.engine.capacity, "token_capacity_swa": None,
                             "graph": {}},
            "decode_cuda_graph_bs": [], "decode_cuda_graph_memory_gb": 0.0,
            "effective_max_running_requests_per_dp": self.profile.capacity.max_running_requests,
            "world_size": 1, "last_gen_throughput": self.engine.gen_throughput(),
        })
        info["internal_states"] = [internal]
        info["startup_time"] = {"load_weight": 0.0, "kv_cache_allocation": 0.0, "scheduler_e2e": 0.0,
                                "tokenizer_e2e": 0.0}
        info["status"] = "ready"
        info["version"] = "0.5.23"
        info["frontend"] = "python"
        return _json(info)

    def _load(self) -> dict[str, Any]:
        e = self.engine
        used = e.used_tokens()
        prefill_queue = len(e.held) if self.mode == "prefill" else 0
        return {
            "timestamp": time.time(), "dp_rank": 0,
            "num_running_reqs": len(e.running) + (1 if e.chunked else 0),
            "num_waiting_reqs": len(e.waiting), "num_waiting_uncached_tokens": e.waiting_uncached_tokens(),
            "num_used_tokens": used, "num_total_tokens": used, "num_active_tokens": e.private_tokens,
            "num_prealloc_ready_tokens": 0, "max_total_num_tokens": e.capacity,
            "max_running_requests": self.profile.capacity.max_running_requests,
            "token_usage": round(used / e.capacity, 4), "gen_throughput": e.gen_throughput(),
            "cache_hit_rate": e.cache_hit_rate(),
            "utilization": round((len(e.running) + len(e.waiting)) / self.profile.capacity.max_running_requests, 4),
            "total_prefill_uncached_tokens": e.stats.prompt_tokens_total - e.stats.cached_tokens_total,
            # Wall time, as a real worker reports it (the engine counts model time).
            "total_prefill_busy_us": int(e.stats.prefill_busy_s * self.time_scale * 1e6),
            "decode_moments": [0.0] * 6,
            "memory": {"weight_gb": 0.0, "kv_cache_gb": 0.0, "graph_gb": 0.0, "token_capacity": e.capacity},
            "disaggregation": {
                "mode": self.mode, "prefill_bootstrap_queue_reqs": 0,
                "prefill_inflight_queue_reqs": prefill_queue,
                "decode_prealloc_queue_reqs": self.bootstrapping if self.mode == "decode" else 0,
                "decode_transfer_queue_reqs": len(e.transferring),
                "decode_retracted_queue_reqs": 0, "kv_transfer_speed_gb_s": 0.0, "kv_transfer_latency_ms": 0.0,
            },
            "queues": {"waiting": len(e.waiting), "grammar": 0, "paused": 0,
                       "retracted": e.stats.num_retractions_total, "prealloc_ready": 0},
        }

    async def loads(self, http: web.Request) -> web.Response:
        include = http.query.get("include")
        load = self._load()
        if include:
            wanted = {s.strip() for s in include.split(",")}
            known = {"core", "memory", "spec", "lora", "disagg", "queues", "all"}
            if not wanted <= known:
                return _json({"object": "error", "message": f"unknown include section(s): "
                              f"{', '.join(sorted(wanted - known))}", "type": "400", "code": 400}, 400)
            if "all" not in wanted:
                for section, key in (("memory", "memory"), ("disagg", "disaggregation"), ("queues", "queues")):
                    if section not in wanted:
                        load.pop(key)
        return _json({
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
            "version": "0.5.23", "accelerator": None, "num_accelerators": 1, "loads": [load],
        })

    async def metrics(self, _http: web.Request) -> web.Response:
        return web.Response(text=self._metrics_text(), content_type="text/plain", charset="utf-8")

    def _metrics_text(self) -> str:
        e, s = self.engine, self.engine.stats
        sched = f'engine_type="{self._engine_type()}",model_name="{self.model_name}",moe_ep_rank="0",pp_rank="0",tp_rank="0"'
        tok = f'engine_type="{self._engine_type()}",model_name="{self.model_name}"'
        lines: list[str] = []

        def gauge(name: str, value: float, labels: str = sched) -> None:
            lines.append(f"# TYPE sglang:{name} gauge")
            lines.append(f"sglang:{name}{{{labels}}} {float(value)}")

        def counter(name: str, value: float) -> None:
            lines.append(f"# TYPE sglang:{name} counter")
            lines.append(f"sglang:{name}{{{tok}}} {float(value)}")

        def histogram(name: str, h: Any) -> None:
            lines.append(f"# TYPE sglang:{name} histogram")
            lines.append(f"sglang:{name}_sum{{{tok}}} {h.total}")
            cumulative = 0
            for bound, n in zip(h.buckets, h.counts, strict=False):
                cumulative += n
                lines.append(f'sglang:{name}_bucket{{{tok},le="{bound}"}} {float(cumulative)}')
            lines.append(f'sglang:{name}_bucket{{{tok},le="+Inf"}} {float(h.count)}')
            lines.append(f"sglang:{name}_count{{{tok}}} {float(h.count)}")

        used = e.used_tokens()
        gauge("num_running_reqs", len(e.running) + (1 if e.chunked else 0))
        gauge("num_queue_reqs", len(e.waiting))
        gauge("num_used_tokens", used)
        gauge("max_total_num_tokens", e.capacity)
        gauge("token_usage", used / e.capacity)
        gauge("full_token_usage", used / e.capacity)
        gauge("kv_used_tokens", used)
        gauge("kv_available_tokens", e.capacity - used)
        gauge("kv_evictable_tokens", e.evictable_tokens())
        gauge("gen_throughput", e.gen_throughput())
        gauge("cache_hit_rate", e.cache_hit_rate())
        gauge("num_retracted_reqs", 0)
        gauge("num_prefill_bootstrap_queue_reqs", 0)
        gauge("num_prefill_inflight_queue_reqs", len(e.held))
        gauge("num_decode_prealloc_queue_reqs", self.bootstrapping)
        gauge("num_decode_transfer_queue_reqs", len(e.transferring))
        gauge("new_token_ratio", self.profile.capacity.new_token_ratio)
        gauge("page_size", 1)
        gauge("utilization", (len(e.running) + len(e.waiting)) / self.profile.capacity.max_running_requests)
        counter("prompt_tokens_total", s.prompt_tokens_total)
        counter("generation_tokens_total", s.generation_tokens_total)
        counter("cached_tokens_total", s.cached_tokens_total)
        counter("num_requests_total", s.num_requests_total)
        counter("http_requests_total", self.http_requests_total)
        histogram("time_to_first_token_seconds", s.ttft)
        histogram("inter_token_latency_seconds", s.itl)
        histogram("e2e_request_latency_seconds", s.e2e)
        histogram("queue_time_seconds", s.queue_time)
        return "\n".join(lines) + "\n"

    def _engine_type(self) -> str:
        return "unified" if self.mode == "null" else self.mode


async def serve_forever(server: WorkerServer) -> None:
    await server.start()
    mode = "" if server.mode == "null" else f" ({server.mode}, bootstrap port {server.bootstrap_port})"
    print(f"emulated SGLang worker '{server.profile.name}' on http://{server.host}:{server.port}{mode}, "
          f"time scale {server.time_scale}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await server.close()
