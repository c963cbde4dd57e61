"""The scheduler's metrics through the OpenTelemetry metrics SDK as well as /metrics.

One source of truth: SchedulerMetrics' prometheus_client registry. Each of its counter and gauge
families becomes an observable instrument (`dspark.<name>`, the Prometheus name with `:` -> `.`)
whose callback collects the current values, so the OTLP or console exporter ships exactly what
/metrics shows.
"""

from __future__ import annotations

from typing import Iterable

from opentelemetry.metrics import CallbackOptions, Meter, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (ConsoleMetricExporter, MetricReader,
                                              PeriodicExportingMetricReader)
from opentelemetry.sdk.resources import Resource

from dspark.serving.config import TraceExporter, TracingFields
from dspark.serving.metrics import PREFIX, SchedulerMetrics

EXPORT_INTERVAL_MS = 15_000


def register_instruments(metrics: SchedulerMetrics, meter: Meter) -> list[str]:
    """Create one observable instrument per counter and gauge of the metrics' registry; returns
    their names (`dspark.<sample name>`, e.g. `dspark.generation_tokens_total`)."""
    names = []
    for family in metrics.registry.collect():  # the families are fixed; their samples change
        if family.type not in ("counter", "gauge"):
            continue
        sample_name = family.name + "_total" if family.type == "counter" else family.name

        def observe(options: CallbackOptions, family_name: str = family.name,
                    sample_name: str = sample_name) -> Iterable[Observation]:
            current = next(f for f in metrics.registry.collect() if f.name == family_name)
            return [Observation(s.value, s.labels) for s in current.samples
                    if s.name == sample_name]

        otel_name = "dspark." + sample_name.removeprefix(PREFIX)
        if family.type == "counter":
            meter.create_observable_counter(otel_name, [observe], description=family.documentation)
        else:
            meter.create_observable_gauge(otel_name, [observe], description=family.documentation)
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
