"""The HTTP face of an emulated worker: SGLang 0.5.23's endpoints over aiohttp + uvloop.

Routes serve generation (``/generate``, ``/v1/completions``, ``/v1/chat/completions``) and
control (``/abort_request``, ``/flush_cache``, health); the status bodies come from
``status.py``, ``/metrics`` from ``metrics.py``, PD pairing from ``pd.py``. The emulator's own
routes live under ``/emulator/``: the fault switches and the request log (``faults.py``), and
the sparse techniques' live state (``/emulator/sparse``, ``status.sparse``).
Health probes that use SGLang's fake bootstrap host (2.2.2.2) skip the PD pairing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from omniinfer.emulator import protocol as proto
from omniinfer.emulator import status
from omniinfer.emulator.engine import EmulatedEngine
from omniinfer.emulator.faults import FaultError, Faults, RequestLog
from omniinfer.emulator.kv_event_publisher import ZmqKvEventPublisher
from omniinfer.emulator.load_publisher import LoadPublisher
from omniinfer.emulator.metrics import WorkerMetrics
from omniinfer.emulator.pd import bootstrap_app, pull_kv
from omniinfer.emulator.profile import Profile
from omniinfer.emulator.protocol import BadRequest, validation_error
from omniinfer.emulator.request import EmuRequest
from omniinfer.kv_event_wire import parse_kv_events_config
from omniinfer.load_feed_wire import DECODE_PUBLISH_INTERVAL, resolve_load_endpoint

logger = logging.getLogger("omniinfer.emulator")
FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # sglang.srt.disaggregation.utils.FAKE_BOOTSTRAP_HOST
SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
FIRST_BYTE_AT = "emulator_first_byte_at"  # per-request key: when the answer may start
EXIT_STATUS = 70  # the exit_after_tokens fault's exit code


def _dumps(obj: Any) -> bytes:
    return orjson.dumps(obj)


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=_dumps(obj), status=status, content_type="application/json")


def _event(obj: Any) -> bytes:
    return b"data: " + _dumps(obj) + b"\n\n"


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
        load_publish_endpoint: str | None = None,
        load_snapshot_publish_interval: int = DECODE_PUBLISH_INTERVAL,
        faults: Faults | None = None,
        request_log_size: int = 256,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.incremental = incremental_streaming_output
        self.ssl_context = ssl_context  # HTTPS on the main port (``tls_context``)
        self.engine = EmulatedEngine(profile, mode=mode, time_scale=time_scale)
        self.tokenizer = self.engine.tokenizer
        self.model_name = profile.model.served_model_name
        # SGLang's --kv-events-config (raw JSON, as /server_info reports it); ValueError if bad
        kv_events = parse_kv_events_config(kv_events_config) if kv_events_config else None
        # --load-publish-endpoint: ValueError naming the reason if it cannot work
        load_endpoint = resolve_load_endpoint(load_publish_endpoint, kv_events)
        self.info = status.WorkerInfo(profile, mode, host, port, bootstrap_port, time_scale,
                                      kv_events_config, kv_events, load_publish_endpoint,
                                      load_endpoint)
        self.load_publisher = None if load_endpoint is None else LoadPublisher(
            *load_endpoint, snapshot=lambda: status.load_stat(self.info, self.engine),
            passing=lambda: self.engine.passing, decode_interval=load_snapshot_publish_interval)
        self.metrics = WorkerMetrics(self.info, self.engine)
        self.faults = faults or Faults()
        self.log = RequestLog(request_log_size)
        self.kv_publisher: ZmqKvEventPublisher | None = None
        self._client: aiohttp.ClientSession | None = None
        self._runners: list[web.AppRunner] = []

    # -- app ----------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[self._errors])
        r = app.router
        for method in ("POST", "PUT"):
            r.add_route(method, "/generate", self.generate)
        r.add_post("/v1/completions", self.completions)
        r.add_post("/v1/chat/completions", self.chat)
        for path in ("/health", "/health_generate", "/ready"):
            r.add_get(path, self.health)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self.model_info)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self.server_info)
        r.add_get("/v1/loads", self.loads)
        r.add_get("/v1/models", self.models)
        r.add_get("/metrics", self.metrics_page)
        for method in ("GET", "POST"):
            r.add_route(method, "/flush_cache", self.flush_cache)
        r.add_post("/abort_request", self.abort_request)
        r.add_get("/emulator/faults", self.get_faults)
        r.add_post("/emulator/faults", self.set_faults)
        r.add_delete("/emulator/faults", self.clear_faults)
        r.add_get("/emulator/requests", self.requests_log)
        r.add_get("/emulator/sparse", self.sparse)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, _app: web.Application) -> None:
        kv_events = self.info.kv_events
        if kv_events is not None and kv_events.enabled:
            self.kv_publisher = ZmqKvEventPublisher(kv_events)
            self.kv_publisher.start()
            if self.engine.kv.tree is not None:
                self.engine.kv.tree.attach_events(self.kv_publisher.recorder)
        if self.load_publisher is not None:
            self.load_publisher.start()
            self.engine.on_pass = self.load_publisher.after_pass
        self.engine.start()
        if self.info.mode == "decode":
            self._client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))

    async def _on_cleanup(self, _app: web.Application) -> None:
        await self.engine.stop()
        if self.kv_publisher is not None:
            await self.kv_publisher.close()
        if self.load_publisher is not None:
            await self.load_publisher.close()
        if self._client is not None:
            await self._client.close()

    async def start(self) -> None:
        """Serve (and the bootstrap endpoint in prefill mode) until cancelled."""
        runner = web.AppRunner(self.app(), access_log=None, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, self.info.host, self.info.port, backlog=4096,
                          ssl_context=self.ssl_context).start()
        self._runners.append(runner)
        if self.info.mode == "prefill":
            boot = web.AppRunner(bootstrap_app(self.engine, self.info.profile), access_log=None)
            await boot.setup()
            await web.TCPSite(boot, self.info.host, self.info.bootstrap_port, backlog=4096).start()
            self._runners.append(boot)

    async def close(self) -> None:
        for runner in reversed(self._runners):
            await runner.cleanup()
        self._runners.clear()

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        resource = request.match_info.route.resource
        endpoint = resource.canonical if resource is not None else request.path
        self.metrics.http.started(endpoint, request.method)
        answered: int | None = None
        try:
            response = await handler(request)
            answered = response.status
            return response
        except BadRequest as exc:
            answered = exc.status
            return _json(exc.body, exc.status)
        except web.HTTPException as exc:
            answered = exc.status
            raise
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception as exc:  # a bug in the emulator: say so, keep serving
            logger.exception("internal error on %s", request.path)
            answered = 500
            return _json({"error": {"message": f"emulator internal error: {type(exc).__name__}: {exc}"}}, 500)
        finally:
            self.metrics.http.finished(endpoint, request.method, answered)

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

    async def _generation_body(self, http: web.Request, openai: bool) -> Any:
        """Read and log a generation request; the fail_status fault answers it here."""
        http[FIRST_BYTE_AT] = time.monotonic() + self.faults.first_byte_delay_s
        body = await self._body(http)
        self.log.request(http.path, body, http.headers.get("Authorization"))
        fail = self.faults.fail_status
        if fail:
            message = f"emulated fault: fail_status {fail}"
            shape = ({"object": "error", "message": message, "type": "EmulatedFault", "param": None,
                      "code": fail} if openai else {"error": {"message": message}})
            await self._first_byte(http)
            raise BadRequest(message, shape, fail)
        return body

    async def _first_byte(self, http: web.Request) -> None:
        """The first_byte_delay_s fault: the answer starts no earlier than it says."""
        delay = http[FIRST_BYTE_AT] - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)

    async def _overhead(self) -> None:
        delay = self.info.profile.cost.request_overhead_s * self.info.time_scale
        if delay > 0:
            await asyncio.sleep(delay)

    async def _start_request(self, ids: list[int], max_new: int, pd: proto.ParsedGenerate,
                             rid: str | None = None, stream: bool = False) -> EmuRequest:
        room = None if pd.bootstrap_host == FAKE_BOOTSTRAP_HOST else pd.bootstrap_room
        request = EmuRequest(ids, max_new, bootstrap_room=room, stream=stream,
                             stall_after_tokens=self.faults.hang_after_tokens)
        if rid:
            request.rid = rid
        request.received_ts = time.time()
        await self._overhead()
        try:
            if self.info.mode != "decode":
                return self.engine.submit(request)
            if pd.bootstrap_room is None or pd.bootstrap_host is None:
                raise BadRequest("a decode worker needs bootstrap_host, bootstrap_port and bootstrap_room")
            if pd.bootstrap_host == FAKE_BOOTSTRAP_HOST or request.stalled:
                return self.engine.submit_transferred(request)
            self.engine.begin_bootstrap(request)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        assert self._client is not None
        try:
            failed = await pull_kv(self._client, self.info.profile, request, pd.bootstrap_host,
                                   pd.bootstrap_port or 8998, pd.bootstrap_room)
        except BaseException:  # the client left: the request must not stay registered
            self.engine.fail(request, "the client left while the KV was on its way")
            raise
        if request.finished:  # aborted while waiting: answered as an aborted request
            return request
        if failed is not None:
            self.engine.fail(request, f"KV transfer failed: {failed}")
            raise BadRequest(f"KV transfer failed: {failed}", status=503)
        return self.engine.submit_transferred(request)

    async def _progress(self, http: web.Request, request: EmuRequest) -> AsyncIterator[int]:
        """Yields the number of output tokens each time the request makes progress; after the
        caller has sent them, the token-count faults act."""
        seen = 0
        while True:
            if len(request.output_ids) > seen:
                seen = len(request.output_ids)
                yield seen
                self._token_faults(http, seen)
            if request.finished:
                return
            await request.wait_progress()

    def _token_faults(self, http: web.Request, tokens: int) -> None:
        if self.faults.reached(self.faults.exit_after_tokens, tokens):
            logger.warning("exit_after_tokens fault: exiting after %d tokens", tokens)
            logging.shutdown()
            os._exit(EXIT_STATUS)
        if self.faults.reached(self.faults.disconnect_after_tokens, tokens):
            if http.transport is not None:
                http.transport.close()
            # ends the handler as a client disconnect does (aiohttp logs no error for it)
            raise asyncio.CancelledError("disconnect_after_tokens fault")

    async def _wait(self, http: web.Request, request: EmuRequest) -> None:
        async for _ in self._progress(http, request):
            pass

    def _abort_if_running(self, request: EmuRequest) -> None:
        if not request.finished:
            self.engine.abort(request.rid)

    async def _run_whole(self, http: web.Request, request: EmuRequest) -> None:
        """A non-streamed request run to its end (aborted if the client goes first), then the
        answer's first-byte delay."""
        try:
            await self._wait(http, request)
        finally:
            self._abort_if_running(request)
        await self._first_byte(http)

    # -- /generate ----------------------------------------------------------------------------
    async def generate(self, http: web.Request) -> web.StreamResponse:
        body = await self._generation_body(http, openai=False)
        parsed = proto.parse_generate(body, self.tokenizer)
        dispatch_ts = time.time()
        rids = parsed.rid or [None] * len(parsed.prompts)
        if parsed.batched:
            requests: list[EmuRequest] = []
            try:
                for ids, rid in zip(parsed.prompts, rids, strict=True):
                    requests.append(await self._start_request(ids, parsed.max_new_tokens, parsed, rid))
                await asyncio.gather(*(self._wait(http, r) for r in requests))
            finally:
                for r in requests:
                    self._abort_if_running(r)
            await self._first_byte(http)
            return _json([proto.generate_body(r, self.tokenizer, True, dispatch_ts) for r in requests])
        request = await self._start_request(parsed.prompts[0], parsed.max_new_tokens, parsed, rids[0],
                                            parsed.stream)
        if not parsed.stream:
            await self._run_whole(http, request)
            if request.error:
                return _json({"error": {"message": request.error}}, 503)
            return _json(proto.generate_body(request, self.tokenizer, True, dispatch_ts))
        response = web.StreamResponse(headers=SSE_HEADERS)
        try:
            await self._first_byte(http)
            await response.prepare(http)
            sent, final_sent = 0, False
            async for count in self._progress(http, request):
                final_sent = request.finished and count == len(request.output_ids)
                start = sent if self.incremental else 0
                chunk = proto.generate_body(request, self.tokenizer, final_sent, dispatch_ts, count, start)
                await response.write(_event(chunk))
                sent = count
            if request.error:
                await response.write(_event({"error": {"message": request.error, "type": "invalid_request_error",
                                                       "code": 503, "retryable": True}}))
            elif not final_sent:  # aborted, or finished without a new token: the finish reason
                start = sent if self.incremental else 0
                await response.write(_event(proto.generate_body(request, self.tokenizer, True, dispatch_ts,
                                                                start=start)))
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
        body = await self._generation_body(http, openai=True)
        ids, max_tokens, stream, include_usage, pd = proto.parse_openai(
            body, chat, self.tokenizer, self.info.profile.model.default_system_prompt
        )
        model = body.get("model") if isinstance(body.get("model"), str) else self.model_name
        rid, created = proto.new_id(), int(time.time())
        request = await self._start_request(ids, max_tokens, pd, body.get("rid") if isinstance(body.get("rid"), str) else None,
                                            stream)
        error = {"object": "error", "message": request.error, "type": "Service Unavailable",
                 "param": None, "code": 503}
        if not stream:
            await self._run_whole(http, request)
            if request.error:
                return _json({**error, "message": request.error}, 503)
            text = self.tokenizer.decode(request.output_ids)
            build = proto.chat_body if chat else proto.completion_body
            return _json(build(request, text, model, rid, created))
        response = web.StreamResponse(headers=SSE_HEADERS)
        obj = "chat.completion.chunk" if chat else "text_completion"
        try:
            await self._first_byte(http)
            await response.prepare(http)
            if chat:
                first = proto.chat_chunk({"reasoning_content": None, "role": "assistant", "content": ""},
                                         None, model, rid, created)
                await response.write(_event(first))
            sent, final_sent = 0, False
            async for count in self._progress(http, request):
                text = self.tokenizer.decode(request.output_ids[sent:count])
                sent = count
                last = request.finished and count == len(request.output_ids)
                if chat:
                    chunk = proto.chat_chunk({"reasoning_content": None, "content": text}, None, model, rid, created)
                else:
                    final_sent = last
                    chunk = proto.completion_chunk(text, proto.finish_reason_name(request) if last else None,
                                                   model, rid, created)
                await response.write(_event(chunk))
            if request.error:
                await response.write(_event({"error": {**error, "message": request.error}}))
            elif chat:
                end = proto.chat_chunk({"reasoning_content": None}, proto.finish_reason_name(request),
                                       model, rid, created)
                await response.write(_event(end))
            elif not final_sent:
                end = proto.completion_chunk("", proto.finish_reason_name(request), model, rid, created)
                await response.write(_event(end))
            if include_usage and not request.error:
                await response.write(_event(proto.usage_chunk(request, obj, model, rid, created)))
            await response.write(b"data: [DONE]\n\n")
        finally:
            self._abort_if_running(request)
        return response

    # -- control ------------------------------------------------------------------------------
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
        self.log.abort(rid, abort_all)
        self.engine.abort(rid, abort_all=abort_all)
        return web.Response(status=200)

    async def flush_cache(self, _http: web.Request) -> web.Response:
        if self.engine.flush_cache():
            return web.Response(text=(
                "Cache flushed.\nPlease check backend logs for more details. "
                "(When there are running or waiting requests, the operation will not be performed.)\n"
            ))
        return web.Response(text="Cache not flushed: there are running or waiting requests.\n", status=400)

    async def get_faults(self, _http: web.Request) -> web.Response:
        return _json(self.faults.as_dict())

    async def set_faults(self, http: web.Request) -> web.Response:
        try:
            self.faults.update(await self._body(http))
        except FaultError as exc:
            raise validation_error(str(exc)) from None
        logger.warning("fault switches now %s", self.faults.as_dict())
        return _json(self.faults.as_dict())

    async def clear_faults(self, _http: web.Request) -> web.Response:
        self.faults = Faults()
        return _json(self.faults.as_dict())

    async def requests_log(self, _http: web.Request) -> web.Response:
        return _json(self.log.as_dict())

    # -- status -------------------------------------------------------------------------------
    async def model_info(self, _http: web.Request) -> web.Response:
        return _json(status.model_info(self.info))

    async def models(self, _http: web.Request) -> web.Response:
        return _json(status.models(self.info))

    async def server_info(self, _http: web.Request) -> web.Response:
        return _json(status.server_info(self.info, self.engine))

    async def sparse(self, _http: web.Request) -> web.Response:
        return _json(status.sparse(self.info, self.engine))

    async def loads(self, http: web.Request) -> web.Response:
        body, code = status.loads(self.info, self.engine, http.query.get("include"))
        return _json(body, code)

    async def metrics_page(self, _http: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": WorkerMetrics.content_type})


async def serve_forever(server: WorkerServer) -> None:
    await server.start()
    info = server.info
    mode = "" if info.mode == "null" else f" ({info.mode}, bootstrap port {info.bootstrap_port})"
    print(f"emulated SGLang worker '{info.profile.name}' on http://{info.host}:{info.port}{mode}, "
          f"time scale {info.time_scale}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await server.close()
