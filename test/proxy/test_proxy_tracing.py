"""OpenTelemetry traces: with ``--enable-trace`` each request is one span, exported by the
OpenTelemetry SDK's OTLP exporters to a local receiver (gRPC, and HTTP/protobuf), the child of
the client's ``traceparent``; the workers receive the span's context as ``traceparent``."""

from __future__ import annotations

import asyncio
from concurrent import futures
from typing import Any

import aiohttp
import grpc
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from router_inproc import ScriptedWorker, router_for

from omniinfer.child_process import free_port
from omniinfer.proxy.config import RouterConfig

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """A local OTLP/gRPC trace receiver that keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[Any] = []

    def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 (the gRPC method name)
        for resource in request.resource_spans:
            for scope in resource.scope_spans:
                self.spans.extend(scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


async def _generate(request: web.Request) -> web.Response:
    return web.json_response({"text": "a", "meta_info": {"completion_tokens": 1}})


def _attributes(span: Any) -> dict[str, Any]:
    out = {}
    for kv in span.attributes:
        value = kv.value
        out[kv.key] = value.string_value or value.int_value or value.double_value
    return out


def _check(spans: list[Any], worker: ScriptedWorker) -> None:
    ours = [s for s in spans if s.name == "omniproxy /generate"]
    assert len(ours) == 2
    child = next(s for s in ours if s.trace_id.hex() == TRACE_ID)
    assert child.parent_span_id.hex() == PARENT_ID  # the client's span is its parent
    attributes = _attributes(child)
    assert attributes["omniproxy.request_id"] == "trace-me"
    assert attributes["http.response.status_code"] == 200
    assert attributes["omniproxy.decision.0"].startswith("regular http://127.0.0.1:")
    sent = [h.get("traceparent") for _, path, h, _ in worker.seen if path == "/generate"]
    assert len(sent) == 2 and all(sent)
    forwarded = next(t for t in sent if TRACE_ID in t)
    assert forwarded.split("-")[2] == child.span_id.hex()  # the worker continues our span
    orphan = next(s for s in ours if s is not child)
    assert not orphan.parent_span_id  # no traceparent from the client: a root span


async def _two_requests(base: str) -> None:
    async with aiohttp.ClientSession() as session:
        for headers in ({"traceparent": TRACEPARENT, "X-Request-Id": "trace-me"}, {}):
            async with session.post(base + "/generate", json={"text": "hi"},
                                    headers=headers) as resp:
                assert resp.status == 200


def test_spans_go_to_an_otlp_grpc_receiver(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    worker = ScriptedWorker({"/generate": _generate})
    try:
        async def run() -> None:
            async with router_for([worker], enable_trace=True,
                                  otlp_traces_endpoint=f"127.0.0.1:{port}") as (base, _):
                await _two_requests(base)
        asyncio.run(run())  # closing the router exports what is batched
    finally:
        server.stop(0)
    _check(receiver.spans, worker)


def test_spans_go_to_an_otlp_http_receiver(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    spans: list[Any] = []

    async def traces(request: web.Request) -> web.Response:
        message = trace_service_pb2.ExportTraceServiceRequest()
        message.ParseFromString(await request.read())
        for resource in message.resource_spans:
            for scope in resource.scope_spans:
                spans.extend(scope.spans)
        return web.Response(body=trace_service_pb2.ExportTraceServiceResponse()
                            .SerializeToString(), content_type="application/x-protobuf")

    worker = ScriptedWorker({"/generate": _generate})

    async def run() -> None:
        app = web.Application()
        app.router.add_post("/v1/traces", traces)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            async with router_for([worker], enable_trace=True,
                                  otlp_traces_endpoint=f"http://127.0.0.1:{port}/v1/traces"
                                  ) as (base, _):
                await _two_requests(base)
                await asyncio.sleep(0)
            # the exporter posts from its own thread while the loop keeps serving
            for _ in range(100):
                if len([s for s in spans if s.name == "omniproxy /generate"]) >= 2:
                    break
                await asyncio.sleep(0.05)
        finally:
            await runner.cleanup()

    asyncio.run(run())
    _check(spans, worker)


def test_an_unknown_protocol_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "carrier-pigeon")
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        RouterConfig(worker_urls=["http://a:1"], enable_trace=True).validate()
