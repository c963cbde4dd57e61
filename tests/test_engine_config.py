"""EngineConfig is composed of its parts' configs, and every default is written once: no field of
a part is repeated in the engine's config, nor in the service flags that set the engine."""

from __future__ import annotations

import dataclasses

import pytest

from dspark.admission import AdmissionConfig, AdmissionPolicy, AsyncTopKAdmission
from dspark.batching import BatchingConfig
from dspark.cost_table import CostTable, ThetaObjective
from dspark.drafting_gate import DraftingGateConfig
from dspark.engine import EngineConfig


def field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_no_field_of_a_part_is_restated():
    parts = EngineConfig.parts()
    assert {f.name: f.type for f in dataclasses.fields(EngineConfig) if f.name in parts}
    own = field_names(EngineConfig) - set(parts)
    seen: dict[str, str] = {name: "EngineConfig" for name in own}
    for part, kind in parts.items():
        assert isinstance(getattr(EngineConfig(), part), kind)
        for name in field_names(kind):
            assert name not in seen, f"{kind.__name__}.{name} is also a field of {seen[name]}"
            seen[name] = kind.__name__


def test_the_parts_defaults_are_the_engines():
    """The engine's default config is its parts' default configs, and the stateful admission
    takes its parameters from the config (none of its own)."""
    config = EngineConfig()
    assert config.admission == AdmissionConfig() and config.gate == DraftingGateConfig()
    assert config.batching == BatchingConfig()
    # The behaviour served: async_topk charging drafting to the round, a 5% margin.
    assert config.admission.policy == AdmissionPolicy.parse("async_topk")
    assert config.admission.objective is ThetaObjective.SHARED_DEVICE
    assert config.admission.min_gain == 1.05
    admission = AsyncTopKAdmission(CostTable.from_step_seconds({1: 0.01}))
    assert (admission.objective, admission.min_gain, admission.lag) == (
        ThetaObjective.SHARED_DEVICE, 1.05, 2)


def test_service_flags_take_the_engines_defaults():
    """Every scheduler flag that sets the engine names an EngineConfig field (its own or a
    part's) and has no default of its own."""
    from dspark.serving.config import SchedulerConfig, engine_fields

    for f in engine_fields(SchedulerConfig):
        assert f.default is dataclasses.MISSING and f.default_factory is not dataclasses.MISSING
        EngineConfig.field_path(f.metadata["engine_field"])  # raises for an unknown name


def test_with_values_routes_names_to_their_parts():
    config = EngineConfig().with_values(policy="fixed:2", max_running=3, probe_interval=0,
                                        max_probe_interval=0, sparse_top_k=5)
    assert config.admission == AdmissionConfig(policy="fixed:2")
    assert config.batching == BatchingConfig(max_running=3)
    assert config.gate == DraftingGateConfig(probe_interval=0, max_probe_interval=0)
    assert config.sparse_top_k == 5 and config.value("max_running") == 3
    with pytest.raises(TypeError, match="no field 'gamma'"):
        EngineConfig().with_values(gamma=4)
    with pytest.raises(ValueError, match="max_running"):
        EngineConfig().with_values(max_running=0)
    with pytest.raises(TypeError, match="must be a BatchingConfig"):
        EngineConfig(batching=DraftingGateConfig())
