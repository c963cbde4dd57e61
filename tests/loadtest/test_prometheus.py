"""loadtest.prometheus reads the figures the sweep needs from the scheduler's real exposition
(SchedulerMetrics rendered by prometheus_client), with counts known from what was recorded."""

from __future__ import annotations

import math

from dspark.serving.metrics import SchedulerMetrics
from loadtest.prometheus import SpeculationDelta, counter_values, round_count, stage_seconds


def test_counters_stages_and_rounds_from_the_exposition():
    m = SchedulerMetrics("tiny")
    before = m.render().decode()
    m.record_speculation(num_admitted=[3, 2, 0], num_accepted=[2, 0, 0])  # 3 blocks, 5 drafts
    m.record_round(generated=5, batch_tokens=8, step_seconds=0.01, capacity=3, running=3, waiting=0)
    m.record_round(generated=1, batch_tokens=3, step_seconds=0.01, capacity=0, running=1, waiting=0)
    m.record_stage_seconds({"draft": 0.25, "verify": 0.5})
    after = m.render().decode()
    assert round_count(before) == 0 and round_count(after) == 2
    assert stage_seconds(after)["verify"] == 0.5 and stage_seconds(after)["admission"] == 0.0
    delta = SpeculationDelta.between(counter_values(before), counter_values(after))
    assert (delta.drafts, delta.draft_tokens, delta.accepted_tokens) == (3, 5, 2)
    assert delta.generated_tokens == 6
    assert delta.mean_verification_length == 5 / 3
    assert delta.acceptance_length == (2 + 3) / 3


def test_a_scheduler_without_speculation():
    text = SchedulerMetrics("tiny").render().decode()
    delta = SpeculationDelta.between(counter_values(text), counter_values(text))
    assert delta.mean_verification_length == 0.0 and math.isnan(delta.acceptance_length)
    assert counter_values("", prefix="dspark:")["generation_tokens_total"] == 0.0
