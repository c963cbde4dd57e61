"""The scheduler's metrics through the OpenTelemetry metrics SDK as well as /metrics.

One source of truth: SchedulerMetrics. Each of its counter and gauge families becomes an
observable instrument (`dspark.<name>`, the Prometheus name with `:` -> `.`) whose callback
reads the current values, so the OTLP or console exporter ships exactly what /metrics shows.
"""

from __future__ import annotations

from typing import Iterable

from opentelemetry.metrics import CallbackOptions, Meter, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (ConsoleMetricExporter, MetricReader,
                                              PeriodicExportingMetricReader)
from opentelemetry.sdk.resources import Resource

from dspark.serving.config import TraceExporter, TracingFields
from dspark.serving.metrics import SchedulerMetrics

EXPORT_INTERVAL_MS = 15_000


def register_instruments(metrics: SchedulerMetrics, meter: Meter) -> list[str]:
    """Create one observable instrument per metric family; returns their names."""
    names = []
    for family in metrics.families():  # the families are fixed; their samples change
        def observe(options: CallbackOptions, name: str = family.name) -> Iterable[Observation]:
            current = next(f for f in metrics.families() if f.name == name)
            base = {"model_name": metrics.model_name}
            return [Observation(value, {**base, **labels}) for labels, value in current.samples]

        otel_name = f"dspark.{family.name}"
        if family.kind == "counter":
            meter.create_observable_counter(otel_name, [observe], description=family.help)
        else:
            meter.create_observable_gauge(otel_name, [observe], description=family.help)
        names.append(otel_name)
    return names


def metric_reader(config: TracingFields) -> MetricReader | None:
    """A periodic exporter for `otlp` and `console`; None for `none` and `file`."""
    if config.trace_exporter is TraceExporter.CONSOLE:
        return PeriodicExportingMetricReader(ConsoleMetricExporter(),
                                             export_interval_millis=EXPORT_INTERVAL_MS)
    if config.trace_exporter is TraceExporter.OTLP:
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

        return PeriodicExportingMetricReader(
            OTLPMetricExporter(endpoint=config.otlp_endpoint, insecure=True),
            export_interval_millis=EXPORT_INTERVAL_MS)
    return None


def setup_metrics(service_name: str, metrics: SchedulerMetrics,
                  reader: MetricReader | None) -> MeterProvider | None:
    if reader is None:
        return None
    provider = MeterProvider(metric_readers=[reader],
                             resource=Resource.create({"service.name": service_name}))
    register_instruments(metrics, provider.get_meter("dspark.scheduler"))
    return provider
