"""The scheduler's metrics: the Prometheus text and the OpenTelemetry SDK bridge carry the same
values (a real MeterProvider with the SDK's in-memory reader)."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client.parser import text_string_to_metric_families

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
    m.record_first_token(0.2)
    return m


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value}, read by prometheus_client's own parser."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_prometheus_text():
    values = samples(filled_metrics().render().decode())
    tiny = (("model_name", "tiny"),)

    def value(name: str, **labels: str) -> float:
        return values[(name, tuple(sorted((*tiny, *labels.items()))))]

    assert value("dspark:spec_decode_num_accepted_tokens_per_pos_total", position="2") == 1
    assert value("dspark:spec_decode_num_verified_tokens_per_pos_total", position="3") == 1
    assert value("dspark:spec_decode_num_draft_tokens_total") == 3
    assert value("dspark:spec_decode_acceptance_length") == 2.0  # (2 accepted + 2 drafts) / 2
    assert value("dspark:spec_decode_mean_verification_length") == 1.5  # 3 drafts / 2 blocks
    assert value("dspark:spec_decode_verify_batch_tokens_bucket", le="8.0") == 1
    assert value("dspark:spec_decode_verify_batch_tokens_bucket", le="4.0") == 0
    assert value("dspark:request_success_total", finished_reason="length") == 1
    assert value("dspark:request_success_total", finished_reason="stop") == 0
    assert value("dspark:spec_decode_target_steps_per_second") == 50.0
    assert value("dspark:round_seconds_total", stage="draft") == 0.5
    assert value("dspark:round_seconds_total", stage="prefill") == 1.0
    assert value("dspark:round_seconds_total", stage="admission") == 0.0
    assert value("dspark:spec_decode_skipped_draft_rounds_total") == 2
    assert value("dspark:num_requests_running") == 2
    assert value("dspark:time_to_first_token_seconds_count") == 1
    assert value("dspark:time_to_first_token_seconds_bucket", le="0.25") == 1
    assert value("dspark:time_to_first_token_seconds_bucket", le="0.1") == 0


def test_fallback_rounds_counter_follows_the_drafters_total():
    m = SchedulerMetrics("tiny")
    for total in (0, 3, 3, 7):
        m.set_fallback_rounds(total)
    values = samples(m.render().decode())
    assert values[("dspark:spec_decode_fallback_rounds_total", (("model_name", "tiny"),))] == 7


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


def test_a_step_result_reaches_the_metrics():
    """record_step reads one engine step's RoundStats: the drafted requests' admitted and
    accepted drafts, the stage seconds (the rest of the wall time as "other"), a skipped
    drafting round, preemptions and the round's batch."""
    from dspark.drafting_gate import RoundMode
    from dspark.step_result import RoundRecord, RoundStats, StageSeconds

    m = SchedulerMetrics("tiny")
    drafted = RoundRecord(["a", "b"], None, [3, 0], [2, 0])
    m.record_step(RoundStats(RoundMode.DRAFT, batch_size=2, batch_tokens=5, capacity=3,
                             drafts_proposed=8, drafts_admitted=3, drafts_accepted=2,
                             seconds=StageSeconds(draft=0.25, verify=0.02), drafted=drafted),
                  wall_seconds=0.5, generated=4, running=2, waiting=1)
    m.record_step(RoundStats(RoundMode.SKIP, batch_size=2, batch_tokens=2, capacity=0,
                             preemptions=1, seconds=StageSeconds(verify=0.01)),
                  wall_seconds=0.25, generated=2, running=2, waiting=0)
    values = samples(m.render().decode())
    tiny = (("model_name", "tiny"),)

    def value(name: str, **labels: str) -> float:
        return values[(name, tuple(sorted((*tiny, *labels.items()))))]

    assert value("dspark:spec_decode_num_draft_tokens_total") == 3
    assert value("dspark:spec_decode_num_accepted_tokens_total") == 2
    assert value("dspark:round_seconds_total", stage="draft") == 0.25
    assert value("dspark:round_seconds_total", stage="other") == pytest.approx(0.23 + 0.24)
    assert value("dspark:spec_decode_skipped_draft_rounds_total") == 1
    assert value("dspark:num_preemptions_total") == 1
    assert value("dspark:spec_decode_target_steps_per_second") == pytest.approx(100.0)
    assert value("dspark:generation_tokens_total") == 6
