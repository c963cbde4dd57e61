"""The drafter-invariant rule through the services: the drafter service told the verifier's rule
(`--verification drafter-invariant`, which `dspark up` passes to both) drafts Gumbel-max samples
with the target's noise, as the embedded engine's drafter does, so the requests accept the same
drafts and give the same tokens as the embedded engine, seeded requests and unseeded ones alike
(the scheduler sends its fresh seed to both services). A drafter left on the token rule still
gives the target's tokens (the rule never depends on the drafts) with other drafts: uncoupled
inverse-CDF samples, which the rule accepts less often on a real drafter (docs/seeded_sampling.md).

The verifier and drafter servicers run in this process behind real gRPC servers; the engine
drives them through RemoteVerifier and RemoteDrafter, as the scheduler does."""

from __future__ import annotations

import argparse

import pytest
import torch
from opentelemetry import trace

from dspark.cost_table import CostTable
from dspark.engine import Engine, EngineConfig
from dspark.loading import load_method_drafter, load_target
from dspark.rejection import VerificationRule
from dspark.sampling import SamplingParams
from dspark.serving import grpc_runtime
from dspark.serving.config import DrafterServiceConfig, VerifierServiceConfig
from dspark.serving.protos import rpc
from dspark.serving.remote_drafter import RemoteDrafter
from dspark.serving.remote_verifier import RemoteVerifier
from dspark.serving.up_cli import stack_processes
from dspark.verifier import TargetVerifier
from loadtest.tiny_models import LAYER_IDS
from services.drafter.main import build_servicer as drafter_servicer
from services.verifier.main import build_servicer as verifier_servicer

PROMPTS = [[5, 6, 7], [11, 3, 9, 27], [40, 41], [8, 8, 8, 2]]
SEEDS = [101, 202, None, None]  # two seeded requests, two that draw a fresh seed at admission
MAX_TOKENS = 24
FRESH_SEEDS_FROM = 1234  # torch.manual_seed before admission: the same fresh seeds in each run


class RecordedDrafts:
    """A drafter that records the tokens of every block it drafts, in order."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.tokens: list[list[int]] = []

    def draft(self, requests, sparse_top_k=None, num_positions=None):
        blocks = self.inner.draft(requests, sparse_top_k=sparse_top_k, num_positions=num_positions)
        self.tokens += [b.tokens.tolist() for b in blocks]
        return blocks

    def __getattr__(self, name):
        return getattr(self.inner, name)


def generate(engine: Engine) -> list:
    torch.manual_seed(FRESH_SEEDS_FROM)
    ids = [engine.add_request(p, SamplingParams(temperature=1.0, seed=s), MAX_TOKENS)
           for p, s in zip(PROMPTS, SEEDS)]
    by_id = {r.request_id: r for r in engine.waiting}
    while engine.has_unfinished():
        engine.step()
    return [by_id[i] for i in ids]


def engine_config(gamma: int) -> EngineConfig:
    # Every round verifies the whole block: acceptance, not admission, decides the drafts kept.
    return EngineConfig().with_values(policy=f"fixed:{gamma}", update_cost_table=False)


@pytest.fixture(scope="module")
def embedded(tiny_models) -> list:
    runner = load_target(tiny_models.target_dir, LAYER_IDS, kv_cache_tokens=4096)
    drafter = load_method_drafter(tiny_models.drafter_dir, runner, apply_calibration=True)
    drafter = RecordedDrafts(drafter)
    engine = Engine(TargetVerifier(runner, VerificationRule.DRAFTER_INVARIANT), drafter,
                    CostTable.load(tiny_models.cost_table), engine_config(drafter.gamma))
    return generate(engine), drafter.tokens


@pytest.fixture(scope="module")
def verifier_address(tiny_models):
    servicer = verifier_servicer(VerifierServiceConfig(
        model_dir=str(tiny_models.target_dir), drafter_dir=str(tiny_models.drafter_dir),
        cost_table=str(tiny_models.cost_table), device="cpu", kv_cache_tokens=4096,
        verification="drafter-invariant"), trace.NoOpTracer())
    server, _, port = grpc_runtime.start_server(servicer, rpc.verifier.add_VerifierServicer_to_server,
                                                "dspark.v1.Verifier", "127.0.0.1", 0)
    yield f"127.0.0.1:{port}"
    server.stop(None)


def through_services(tiny_models, verifier_address: str, drafter_rule: str
                     ) -> tuple[list, list[list[int]]]:
    servicer = drafter_servicer(DrafterServiceConfig(
        model_dir=str(tiny_models.target_dir), drafter_dir=str(tiny_models.drafter_dir),
        device="cpu", verification=drafter_rule), trace.NoOpTracer())
    assert servicer.rule is VerificationRule(drafter_rule)
    server, _, port = grpc_runtime.start_server(servicer, rpc.drafter.add_DrafterServicer_to_server,
                                                "dspark.v1.Drafter", "127.0.0.1", 0)
    try:
        drafter = RecordedDrafts(RemoteDrafter(f"127.0.0.1:{port}"))
        engine = Engine(RemoteVerifier(verifier_address), drafter,
                        CostTable.load(tiny_models.cost_table),
                        engine_config(servicer.drafter.gamma))
        return generate(engine), drafter.tokens
    finally:
        server.stop(None)


def accepted(requests) -> list[int]:
    return [r.metrics.drafts_accepted for r in requests]


def test_the_drafter_told_the_rule_drafts_as_the_embedded_engine(tiny_models, verifier_address,
                                                                 embedded):
    (want, want_drafts), (served, drafts) = embedded, through_services(
        tiny_models, verifier_address, "drafter-invariant")
    assert [r.output_ids for r in served] == [r.output_ids for r in want]
    assert drafts == want_drafts
    assert accepted(served) == accepted(want) and sum(accepted(want)) > 0


def test_a_drafter_on_the_token_rule_drafts_otherwise_with_the_same_tokens_out(
        tiny_models, verifier_address, embedded):
    (want, want_drafts), (served, drafts) = embedded, through_services(
        tiny_models, verifier_address, "token")
    # The rule's output never depends on the drafts; the drafts are inverse-CDF samples here,
    # not the target's Gumbel-max coupling, so they differ.
    assert [r.output_ids for r in served] == [r.output_ids for r in want]
    assert drafts != want_drafts


def test_dspark_up_gives_the_drafter_the_verifiers_rule(tiny_models, tmp_path):
    from dspark.serving.up_cli import configure

    parser = argparse.ArgumentParser()
    configure(parser)
    args = parser.parse_args(["--model-dir", str(tiny_models.target_dir), "--drafter-dir",
                              str(tiny_models.drafter_dir), "--verification",
                              "drafter-invariant"])
    argv = {p.name: p.module_args for p, _ in stack_processes(args, tmp_path)}
    for name in ("verifier", "drafter"):
        flag = argv[name].index("--verification")
        assert argv[name][flag + 1] == "drafter-invariant", (name, argv[name])


def test_an_unknown_rule_is_refused_by_the_drafter_config():
    with pytest.raises(ValueError, match="'gumbel'"):
        DrafterServiceConfig(verification="gumbel")
