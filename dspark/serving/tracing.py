"""OpenTelemetry for the services: one trace per request across scheduler, drafter and verifier.

The scheduler opens a span per request and a span per round (parented to the oldest running
request's span, linked to every request in the round, since one round serves many requests);
its calls to the drafter and verifier carry the W3C `traceparent` in gRPC metadata, and the
services continue that trace in their own spans. Exporters: none, console, OTLP/gRPC, or a
JSON-lines file (one span per line; what the tests read).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Iterable, Sequence

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (BatchSpanProcessor, ConsoleSpanExporter,
                                            SimpleSpanProcessor, SpanExporter, SpanExportResult)

from dspark.serving.config import TraceExporter, TracingFields


class JsonLinesSpanExporter(SpanExporter):
    """Appends one JSON object per finished span to a file (shared safely by several processes:
    each line is one write to a file opened in append mode)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = []
        for s in spans:
            parent = s.parent.span_id if s.parent is not None else None
            lines.append(json.dumps({
                "service": s.resource.attributes.get("service.name"), "name": s.name,
                "trace_id": format(s.context.trace_id, "032x"),
                "span_id": format(s.context.span_id, "016x"),
                "parent_span_id": format(parent, "016x") if parent else None,
                "start_ns": s.start_time, "end_ns": s.end_time,
                "attributes": {k: (list(v) if isinstance(v, tuple) else v)
                               for k, v in (s.attributes or {}).items()},
                "links": [format(link.context.trace_id, "032x") for link in s.links],
            }))
        with self._lock, open(self.path, "a", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in lines))
        return SpanExportResult.SUCCESS


@dataclass
class Tracing:
    """This process's tracer and the provider behind it (None for the no-op tracer)."""

    tracer: trace.Tracer
    provider: TracerProvider | None = None

    def shutdown(self) -> None:
        """Flush spans still buffered (BatchSpanProcessor) before the process exits."""
        if self.provider is not None:
            self.provider.shutdown()


def setup_tracing(service_name: str, config: TracingFields) -> Tracing:
    """A tracer for this process with the configured exporter (a no-op tracer for `none`)."""
    if config.trace_exporter is TraceExporter.NONE:
        return Tracing(trace.NoOpTracer())
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if config.trace_exporter is TraceExporter.CONSOLE:
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    elif config.trace_exporter is TraceExporter.FILE:
        provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(config.trace_file)))
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(
            OTLPSpanExporter(endpoint=config.otlp_endpoint, insecure=True)))
    return Tracing(provider.get_tracer(f"dspark.{service_name}"), provider)


def outgoing_metadata(context: Context | None = None) -> list[tuple[str, str]]:
    """gRPC metadata carrying the current (or given) trace context."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    return list(carrier.items())


def incoming_context(metadata: Iterable[tuple[str, str | bytes]] | None) -> Context:
    """The trace context a caller put in gRPC metadata (an empty context when none)."""
    carrier = {k: v for k, v in (metadata or ()) if isinstance(v, str)}
    return propagate.extract(carrier)
