"""The scheduler's --min-gain and --hold-features flags: parsed into SchedulerConfig, and
min_gain refused below 1."""

from __future__ import annotations

import argparse

import pytest

from dspark.serving.config import SchedulerConfig, add_arguments, from_args


def parse(*argv: str) -> SchedulerConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser, SchedulerConfig, "DSPARK_SCHEDULER")
    return from_args(SchedulerConfig, parser.parse_args(list(argv)))


def test_min_gain_is_a_flag_with_the_engine_default():
    from dspark.engine import EngineConfig

    assert parse().min_gain == EngineConfig().min_gain == 1.05
    assert parse("--min-gain", "1.0").min_gain == 1.0
    with pytest.raises(ValueError, match="min_gain must be >= 1, got 0.9"):
        parse("--min-gain", "0.9")


def test_hold_features_is_a_flag_with_the_engine_default():
    from dspark.engine import EngineConfig

    assert parse().hold_features is EngineConfig().hold_features is True
    assert parse("--hold-features", "false").hold_features is False


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
