"""`dspark up`'s processes: which services it starts, with which drafter and how many threads each,
and what it refuses before starting any."""

from __future__ import annotations

import argparse

import pytest

from dspark import drafter_choice
from dspark.serving import core_split


def up_args(**overrides) -> argparse.Namespace:
    from dspark.serving import up_cli

    parser = argparse.ArgumentParser()
    up_cli.configure(parser)
    args = parser.parse_args([])
    for name, value in overrides.items():
        setattr(args, name, value)
    return args


@pytest.mark.parametrize("drafter_dir, policy, with_drafter", [
    ("ckpt", "async_topk", True), ("ckpt", "none", False), ("none", "async_topk", False),
    ("", "fixed:2", True), ("none", "none", False)])
def test_up_starts_a_drafter_only_when_there_is_one_to_use(tmp_path, monkeypatch, drafter_dir,
                                                            policy, with_drafter):
    from dspark.serving.up_cli import stack_processes

    monkeypatch.setattr(drafter_choice, "DEFAULT_DRAFTER", tmp_path)  # "" = the shipped one
    procs = stack_processes(up_args(drafter_dir=drafter_dir, policy=policy), tmp_path)
    names = [p.name for p, _ in procs]
    assert names == (["verifier", "drafter", "scheduler"] if with_drafter
                     else ["verifier", "scheduler"])
    verifier_args = procs[0][0].module_args
    layers = verifier_args[verifier_args.index("--hidden-layer-ids") + 1]
    assert layers == ("" if with_drafter else "none")
    if with_drafter:
        expected = str(tmp_path) if drafter_dir == "" else drafter_dir
        assert verifier_args[verifier_args.index("--drafter-dir") + 1] == expected


@pytest.mark.parametrize("rule", ["token", "block"])
def test_up_hands_the_verification_rule_to_the_verifier(tmp_path, rule):
    from dspark.serving.up_cli import stack_processes

    procs = stack_processes(up_args(drafter_dir="none", verification=rule), tmp_path)
    verifier_args = procs[0][0].module_args
    assert verifier_args[verifier_args.index("--verification") + 1] == rule


@pytest.mark.parametrize("weights", ["auto", "q4", "dense"])
def test_up_hands_the_weights_to_the_verifier_and_the_service_parses_them(tmp_path, weights):
    from dspark.serving.config import VerifierServiceConfig, from_args
    from dspark.serving.up_cli import stack_processes
    from services.verifier.main import configure

    procs = stack_processes(up_args(drafter_dir="none", weights=weights), tmp_path)
    verifier_args = procs[0][0].module_args
    assert verifier_args[verifier_args.index("--weights") + 1] == weights
    parser = argparse.ArgumentParser()
    configure(parser)
    config = from_args(VerifierServiceConfig, parser.parse_args(verifier_args[1:]))
    assert config.weights == weights


def test_the_verifier_service_refuses_unknown_weights():
    from dspark.serving.config import VerifierServiceConfig

    with pytest.raises(ValueError, match="weights must be auto or one of q4, dense"):
        VerifierServiceConfig(weights="q5")


def test_up_refuses_an_unknown_policy_before_starting_anything(tmp_path, capsys):
    from dspark.serving.up_cli import run

    assert run(up_args(policy="sometimes", log_dir=str(tmp_path))) == 1
    assert "unknown admission policy" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_up_hands_each_model_service_its_share_of_the_cores(tmp_path, monkeypatch):
    from dspark.serving.up_cli import stack_processes

    monkeypatch.setattr(drafter_choice, "DEFAULT_DRAFTER", tmp_path)
    monkeypatch.setattr(core_split, "usable_cores", lambda: 6)

    def threads(procs, name):
        args = next(p.module_args for p, _ in procs if p.name == name)
        return int(args[args.index("--threads") + 1])

    monkeypatch.delenv("DSPARK_SCHEDULER_COHORTS", raising=False)
    procs = stack_processes(up_args(policy="async_topk"), tmp_path)
    assert (threads(procs, "verifier"), threads(procs, "drafter")) == (6, 6)  # they take turns
    procs = stack_processes(up_args(policy="async_topk", extra_scheduler_args="--cohorts 2"),
                            tmp_path)
    assert (threads(procs, "verifier"), threads(procs, "drafter")) == (5, 1)  # they overlap
    procs = stack_processes(up_args(policy="none"), tmp_path)
    assert threads(procs, "verifier") == 6
    procs = stack_processes(up_args(policy="async_topk", verifier_threads=2, drafter_threads=3),
                            tmp_path)
    assert (threads(procs, "verifier"), threads(procs, "drafter")) == (2, 3)


def test_up_refuses_a_negative_thread_count_before_starting_anything(tmp_path, capsys):
    from dspark.serving.up_cli import run

    assert run(up_args(drafter_threads=-1, log_dir=str(tmp_path))) == 1
    assert "thread counts must be >= 0" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
