"""The verifier service's `--verification` flag: token by token by default, the block rule when
asked, and a clear error for anything else (before the model loads)."""

from __future__ import annotations

import argparse

import pytest
from opentelemetry import trace

from dspark.rejection import VerificationRule
from dspark.serving.config import VerifierServiceConfig, add_arguments, from_args
from services.verifier.main import build_servicer


def parse(*argv: str) -> VerifierServiceConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser, VerifierServiceConfig, "DSPARK_VERIFIER")
    return from_args(VerifierServiceConfig, parser.parse_args(list(argv)))


def test_an_unknown_rule_is_refused_by_name():
    with pytest.raises(ValueError, match="'blocks'"):
        parse("--verification", "blocks")


@pytest.mark.parametrize("argv, rule", [((), VerificationRule.TOKEN),
                                        (("--verification", "block"), VerificationRule.BLOCK)])
def test_the_flag_reaches_the_verifier(tiny_models, argv, rule):
    config = parse("--model-dir", str(tiny_models.target_dir), "--drafter-dir",
                   str(tiny_models.drafter_dir), "--cost-table", str(tiny_models.cost_table),
                   "--kv-cache-tokens", "1024", *argv)
    assert build_servicer(config, trace.NoOpTracer()).verifier.rule is rule
