"""The scheduler's metrics: the Prometheus text and the OpenTelemetry SDK bridge carry the same
values (a real MeterProvider with the SDK's in-memory reader)."""

from __future__ import annotations

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from dspark.serving.metrics import SchedulerMetrics
from dspark.serving.otel_metrics import register_instruments


def filled_metrics() -> SchedulerMetrics:
    m = SchedulerMetrics("tiny")
    m.record_prompt(7)
    m.record_speculation(num_admitted=[3, 0], num_accepted=[2, 0])
    m.record_round(generated=4, batch_tokens=5, step_seconds=0.02, capacity=3, running=2,
                   waiting=1)
    m.record_finished("length")
    m.record_stage_seconds({"draft": 0.25, "verify": 0.5, "other": 0.125}, skipped_draft_rounds=2)
    m.record_stage_seconds({"draft": 0.25, "prefill": 1.0})
    return m


def test_prometheus_text():
    text = filled_metrics().render()
    assert 'dspark:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="2"} 1' in text
    assert 'dspark:spec_decode_num_verified_tokens_per_pos_total{model_name="tiny",position="3"} 1' in text
    assert 'dspark:spec_decode_num_draft_tokens_total{model_name="tiny"} 3' in text
    assert 'dspark:spec_decode_acceptance_length{model_name="tiny"} 2.0' in text  # (3 + 1) / 2
    assert 'dspark:spec_decode_verify_batch_tokens_bucket{model_name="tiny",le="8"} 1' in text
    assert 'dspark:request_success_total{model_name="tiny",finished_reason="length"} 1' in text
    assert 'dspark:spec_decode_target_steps_per_second{model_name="tiny"} 50.0' in text
    assert 'dspark:round_seconds_total{model_name="tiny",stage="draft"} 0.5' in text
    assert 'dspark:round_seconds_total{model_name="tiny",stage="prefill"} 1.0' in text
    assert 'dspark:round_seconds_total{model_name="tiny",stage="admission"} 0.0' in text
    assert 'dspark:spec_decode_skipped_draft_rounds_total{model_name="tiny"} 2' in text


def test_otel_bridge_exports_the_same_values():
    metrics = filled_metrics()
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    names = register_instruments(metrics, provider.get_meter("test"))
    metrics.record_round(generated=6, batch_tokens=1, step_seconds=0.01, capacity=0, running=0,
                         waiting=0)  # later values are what the callbacks read
    data = reader.get_metrics_data()
    points = {}
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                for p in metric.data.data_points:
                    points[(metric.name, tuple(sorted(p.attributes.items())))] = p.value
    assert "dspark.spec_decode_num_accepted_tokens_total" in names
    assert points[("dspark.generation_tokens_total", (("model_name", "tiny"),))] == 10
    assert points[("dspark.spec_decode_num_accepted_tokens_per_pos_total",
                   (("model_name", "tiny"), ("position", "1")))] == 1
    assert points[("dspark.spec_decode_target_steps_per_second", (("model_name", "tiny"),))] == 100
    assert points[("dspark.round_seconds_total", (("model_name", "tiny"), ("stage", "verify")))] == 0.5
    provider.shutdown()
