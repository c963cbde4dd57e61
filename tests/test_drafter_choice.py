"""The drafter / hidden-layer flags parsed into typed values (dspark.drafter_choice), the policy's
`drafts`, and the places that act on them: the verifier's layers and the
embedded engine `dspark.loading.load_engine` (`dspark up`'s: tests/serving/test_up_cli.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dspark import drafter_choice
from dspark.admission import AdmissionPolicy
from dspark.drafter_choice import drafter_dir_or_shipped, parse_drafter_dir, parse_hidden_layer_ids
from dspark.sampling import SamplingParams
from dspark.serving.config import VerifierServiceConfig


@pytest.mark.parametrize("text", ["", "none", None])
def test_no_drafter_spellings(text):
    assert parse_drafter_dir(text) is None


@pytest.mark.parametrize("text", ["ckpt/dspark", Path("ckpt/dspark")])
def test_a_folder_is_a_path(text):
    assert parse_drafter_dir(text) == Path("ckpt/dspark")


def test_empty_means_the_shipped_drafter_when_present(tmp_path, monkeypatch):
    shipped = tmp_path / "dspark-markov"
    monkeypatch.setattr(drafter_choice, "DEFAULT_DRAFTER", shipped)
    assert drafter_dir_or_shipped("") is None and drafter_dir_or_shipped(None) is None
    shipped.mkdir()
    assert drafter_dir_or_shipped("") == shipped and drafter_dir_or_shipped(None) == shipped
    assert drafter_dir_or_shipped("none") is None
    assert drafter_dir_or_shipped(Path("other")) == Path("other")


@pytest.mark.parametrize("text, layers", [("", None), ("  ", None), ("none", ()), ("7", (7,)),
                                          ("0,2, 3", (0, 2, 3))])
def test_hidden_layer_ids(text, layers):
    assert parse_hidden_layer_ids(text) == layers


@pytest.mark.parametrize("text", ["0,,3", "a,b", "none,1", "1,"])
def test_malformed_hidden_layer_ids_fail_at_config(text):
    with pytest.raises(ValueError, match="hidden layer ids"):
        parse_hidden_layer_ids(text)
    with pytest.raises(ValueError, match="hidden layer ids"):
        VerifierServiceConfig(hidden_layer_ids=text)


@pytest.mark.parametrize("policy, drafts", [("none", False), ("fixed:0", True), ("fixed:3", True),
                                            ("threshold:0.5", True), ("sync_greedy", True),
                                            ("async_topk", True)])
def test_policy_drafts(policy, drafts):
    assert AdmissionPolicy.parse(policy).drafts is drafts


def test_verifier_layers(tmp_path, monkeypatch):
    from loadtest.tiny_models import LAYER_IDS, build_tiny_models
    from services.verifier.main import hidden_layers

    tiny = build_tiny_models(tmp_path)
    monkeypatch.setattr(drafter_choice, "DEFAULT_DRAFTER", tmp_path / "absent")
    assert hidden_layers(VerifierServiceConfig(hidden_layer_ids="1,3")) == (1, 3)
    assert hidden_layers(VerifierServiceConfig(hidden_layer_ids="none",
                                               drafter_dir=str(tiny.drafter_dir))) == ()
    assert hidden_layers(VerifierServiceConfig(drafter_dir=str(tiny.drafter_dir))) == LAYER_IDS
    assert hidden_layers(VerifierServiceConfig(drafter_dir="none")) == ()
    assert hidden_layers(VerifierServiceConfig()) == ()  # no shipped drafter either
    monkeypatch.setattr(drafter_choice, "DEFAULT_DRAFTER", tiny.drafter_dir)
    assert hidden_layers(VerifierServiceConfig()) == LAYER_IDS


@pytest.mark.parametrize("policy, speculative", [("async_topk", True), ("none", False)])
def test_load_engine(tmp_path, policy, speculative):
    from dspark.loading import load_engine
    from loadtest.tiny_models import build_tiny_models

    tiny = build_tiny_models(tmp_path)
    engine, tokenizer = load_engine(tiny.target_dir, tiny.drafter_dir, policy, "float32",
                                    tiny.cost_table, max_running=2)
    assert (engine.drafter is not None) is speculative
    assert str(engine.config.admission.policy) == policy
    done = engine.generate([tokenizer("t5 t6 t7")["input_ids"]], SamplingParams(temperature=0), 6)
    assert len(done[0].output_ids) == 6
