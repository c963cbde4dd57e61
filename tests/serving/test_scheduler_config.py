"""SchedulerConfig from flags: the engine's flags default to EngineConfig's values and reach the
EngineConfig the scheduler builds, min_gain is refused below 1, and API keys stay out of --help."""

from __future__ import annotations

import argparse

import pytest

from dspark.serving.config import SchedulerConfig, add_arguments, engine_fields, from_args


def parse(*argv: str) -> SchedulerConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser, SchedulerConfig, "DSPARK_SCHEDULER")
    return from_args(SchedulerConfig, parser.parse_args(list(argv)))


def test_engine_flags_default_to_the_engine_config():
    from dspark.engine import EngineConfig

    names = {f.name for f in engine_fields(SchedulerConfig)}
    assert names == {"policy", "max_running", "sparse_top_k", "prefill_chunk_tokens",
                     "probe_requests", "hold_features", "min_gain", "update_cost_table"}
    assert parse().engine_config() == SchedulerConfig().engine_config() == EngineConfig()
    assert parse().policy == "async_topk" and parse().sparse_top_k == 0  # 0 = dense = None


def test_engine_flags_reach_the_engine_config():
    from dspark.admission import AdmissionPolicy

    engine = parse("--policy", "fixed:3", "--max-running", "5", "--sparse-top-k", "8",
                   "--prefill-chunk-tokens", "0", "--probe-requests", "2", "--hold-features",
                   "false", "--min-gain", "1.0", "--update-cost-table", "no").engine_config(
                       kv_cache_tokens=1024)
    assert engine.admission.policy == AdmissionPolicy.parse("fixed:3")
    assert engine.batching.max_running == 5
    assert engine.sparse_top_k == 8 and engine.batching.prefill_chunk_tokens == 0
    assert engine.gate.probe_requests == 2 and engine.hold_features is False
    assert engine.admission.min_gain == 1.0 and engine.update_cost_table is False
    assert engine.batching.kv_cache_tokens == 1024


def test_min_gain_below_one_is_refused():
    with pytest.raises(ValueError, match="min_gain must be >= 1, got 0.9"):
        parse("--min-gain", "0.9")


def test_api_keys_from_env_and_file_stay_out_of_help_and_repr(tmp_path, monkeypatch):
    from dspark.serving.auth import ApiKeys, fingerprint

    keys_file = tmp_path / "keys"
    keys_file.write_text("# comment\nfile-key-1\n\nfile-key-2  # trailing comment\n")
    monkeypatch.setenv("DSPARK_SCHEDULER_API_KEYS", "env-key")
    monkeypatch.setenv("DSPARK_SCHEDULER_INTERNAL_TOKEN", "env-token")
    parser = argparse.ArgumentParser()
    add_arguments(parser, SchedulerConfig, "DSPARK_SCHEDULER")
    config = from_args(SchedulerConfig, parser.parse_args(["--api-keys-file", str(keys_file)]))
    assert config.api_key_set == {"env-key", "file-key-1", "file-key-2"}
    assert config.internal_token_value == "env-token"
    for text in (parser.format_help(), repr(config)):
        assert "env-key" not in text and "env-token" not in text
    keys = ApiKeys(config.api_key_set)
    assert keys.owner("Bearer file-key-2") == fingerprint("file-key-2") != fingerprint("env-key")
    assert keys.owner("Bearer file-key") is None and keys.owner("file-key-1") is None
    assert ApiKeys(frozenset()).owner("") == ""
