"""OpenTelemetry traces (``--enable-trace``, ``--otlp-traces-endpoint``), as sglang-router and
SGLang's server export them.

With ``--enable-trace`` each inference request is one span (``omniproxy /generate`` ...), a
child of the client's ``traceparent`` when it sends one, with the request's id, endpoint,
prompt tokens, the workers chosen (role, URL, DP rank), the answer's status and its TTFT; the
span's context goes to the workers as ``traceparent`` (SGLang's server continues the trace
when it traces too). Spans are batched and exported over OTLP to ``--otlp-traces-endpoint``
(default ``localhost:4317``) with gRPC, or with HTTP/protobuf when
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf`` (the variable SGLang's server reads too;
then give the full URL, ``http://HOST:4318/v1/traces``). An unreachable collector costs
dropped spans, never a request. Without the flag nothing here runs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

log = logging.getLogger("omniinfer.proxy")
PROTOCOL_VARIABLE = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
SERVICE_NAME = "omniproxy"


def exporter(endpoint: str, protocol: str | None = None) -> Any:
    """The OTLP span exporter for ``endpoint``; ValueError for an unknown protocol or a missing
    OpenTelemetry SDK."""
    protocol = protocol or os.environ.get(PROTOCOL_VARIABLE, "grpc")
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            return OTLPSpanExporter(endpoint=endpoint, insecure=True)
        if protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter as HttpExporter,
            )

            return HttpExporter(endpoint=endpoint)
    except ImportError:
        raise ValueError("--enable-trace needs the OpenTelemetry SDK and OTLP exporters: pip "
                         "install 'omniinfer-sglang[trace]'") from None
    raise ValueError(f"{PROTOCOL_VARIABLE}={protocol!r}: only grpc and http/protobuf are "
                     "supported")


def check(protocol: str | None = None) -> None:
    """ValueError unless the SDK and the configured protocol's exporter can be imported."""
    protocol = protocol or os.environ.get(PROTOCOL_VARIABLE, "grpc")
    modules = {"grpc": "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
               "http/protobuf": "opentelemetry.exporter.otlp.proto.http.trace_exporter"}
    if protocol not in modules:
        raise ValueError(f"{PROTOCOL_VARIABLE}={protocol!r}: only grpc and http/protobuf are "
                         "supported")
    import importlib.util

    for module in ("opentelemetry.sdk.trace", modules[protocol]):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            raise ValueError("--enable-trace needs the OpenTelemetry SDK and OTLP exporters: "
                             "pip install 'omniinfer-sglang[trace]'")


class Tracing:
    """The router's tracer; ``begin`` and ``end`` bracket one request."""

    def __init__(self, endpoint: str, span_exporter: Any = None) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = TracerProvider(resource=Resource.create({"service.name": SERVICE_NAME}))
        self.provider.add_span_processor(BatchSpanProcessor(span_exporter or exporter(endpoint)))
        self.tracer = self.provider.get_tracer("omniinfer.proxy")
        self.propagator = TraceContextTextMapPropagator()

    def begin(self, endpoint: str, headers: Mapping[str, str], request_id: str
              ) -> tuple[Any, bytes]:
        """A started span for a request (the client's ``traceparent`` its parent) and the header
        lines that carry its context to the workers."""
        from opentelemetry.trace import SpanKind, set_span_in_context

        parent = self.propagator.extract(headers)
        span = self.tracer.start_span(f"omniproxy /{endpoint}", context=parent,
                                      kind=SpanKind.SERVER,
                                      attributes={"omniproxy.request_id": request_id,
                                                  "omniproxy.endpoint": endpoint})
        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, context=set_span_in_context(span))
        lines = "".join(f"{k}: {v}\r\n" for k, v in carrier.items() if v.isascii())
        return span, lines.encode("latin-1")

    def end(self, span: Any, status: int, record: Mapping[str, Any]) -> None:
        """End ``span`` with what the access log knows of the request (``record``)."""
        from opentelemetry.trace import Status, StatusCode

        span.set_attribute("http.response.status_code", status)
        for key in ("prompt_tokens", "output_tokens", "ttft", "e2e"):
            value = record.get(key)
            if isinstance(value, (int, float)):
                span.set_attribute(f"omniproxy.{key}", value)
        for i, decision in enumerate(record.get("decisions") or ()):
            span.set_attribute(f"omniproxy.decision.{i}", f"{decision.get('role')} "
                               f"{decision.get('worker')} rank={decision.get('dp_rank', '-')}")
        if record.get("error"):
            span.set_attribute("omniproxy.error", str(record["error"])[:300])
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR))
        span.end()

    def close(self) -> None:
        """Export what is batched (bounded by the SDK's export timeout) and stop."""
        try:
            self.provider.shutdown()
        except Exception as exc:  # the collector is gone: the spans are lost, nothing else
            log.warning("trace export at shutdown failed: %s", exc)
