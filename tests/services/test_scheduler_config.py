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
