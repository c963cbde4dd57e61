"""vLLM's logit-space parameters through the services (REST and gRPC Generate, the verifier
service behind them): accepted with their effect (greedy tokens equal the embedded engine's
with the same parameters), refused out of vLLM's ranges with a 400 naming the field /
INVALID_ARGUMENT, and checked again by the verifier service itself. (min_tokens through a
verifier process, with preemption: tests/serving/test_kv_preemption_remote.py; the tiny
stack's tokenizer has no EOS for it to hold back.)"""

from __future__ import annotations

import grpc
import pytest

from dspark.sampling import SamplingParams
from dspark.serving import messages
from dspark.serving.grpc_runtime import channel
from dspark.serving.protos import pb, rpc

from .test_grpc_and_auth import auth, generation_stub

PROMPT = [3, 9, 27, 17]
PROCESSED = {"repetition_penalty": 2.0, "frequency_penalty": 0.5, "presence_penalty": 0.5,
             "logit_bias": {"5": 1.5, "9": -100}, "min_p": 0.1}


def embedded_processed(tiny_models, prompt: list[int], max_tokens: int,
                       params: SamplingParams) -> list[int]:
    """The embedded engine's output (the stack's target, drafter, policy and cost table), no
    stop tokens (the services' requests below send ignore_eos)."""
    from dspark.cost_table import CostTable
    from dspark.engine import AdmissionConfig, Engine, EngineConfig
    from dspark.loading import load_method_drafter, load_target
    from dspark.verifier import TargetVerifier
    from loadtest.tiny_models import LAYER_IDS

    runner = load_target(tiny_models.target_dir, LAYER_IDS, kv_cache_tokens=4096)
    drafter = load_method_drafter(tiny_models.drafter_dir, runner, apply_calibration=True)
    engine = Engine(TargetVerifier(runner), drafter, CostTable.load(tiny_models.cost_table),
                    EngineConfig(AdmissionConfig(policy="async_topk"), update_cost_table=False))
    return engine.generate([prompt], params, max_tokens)[0].output_ids


def test_rest_and_grpc_apply_the_parameters(stack, embedded_greedy):
    bias = {int(t): b for t, b in PROCESSED["logit_bias"].items()}
    params = SamplingParams(temperature=0, **{**PROCESSED, "logit_bias": bias})
    expected = embedded_processed(stack.models, PROMPT, 12, params)
    assert expected != embedded_greedy(PROMPT, 12)  # the parameters change the output
    status, body = stack.post("/v1/completions", {"model": "tiny", "prompt": PROMPT,
                                                   "max_tokens": 12, "temperature": 0,
                                                   "ignore_eos": True, **PROCESSED})
    assert status == 200, body
    assert body["dspark"]["token_ids"] == expected
    sampling = messages.sampling_to_pb(params)
    replies = list(generation_stub(stack).Generate(pb.generation.GenerateRequest(
        model="tiny", prompt_token_ids=PROMPT, max_tokens=12, sampling=sampling,
        ignore_eos=True), metadata=auth(stack), timeout=60))
    assert [t for r in replies for t in r.token_ids] == expected


@pytest.mark.parametrize("extra, param, words", [
    ({"frequency_penalty": 2.5}, "frequency_penalty", "frequency_penalty must be in [-2, 2]"),
    ({"presence_penalty": -3}, "presence_penalty", "presence_penalty must be in [-2, 2]"),
    ({"repetition_penalty": 0}, "repetition_penalty", "repetition_penalty must be > 0"),
    ({"min_p": 1.5}, "min_p", "min_p must be in [0, 1]"),
    ({"logit_bias": {"5": 150}}, "logit_bias", "logit_bias values must be in [-100, 100]"),
    ({"logit_bias": {"64": 1}}, "logit_bias", "logit_bias keys must be token ids in 0..63"),
    ({"logit_bias": {"x": 1}}, "logit_bias", "logit_bias keys must be token ids"),
    ({"logit_bias": {"5": "up"}}, "logit_bias", "logit_bias must be a number"),
    ({"min_tokens": 5}, "min_tokens", "min_tokens must be in 0..max_tokens (4)"),
    ({"min_tokens": -1}, "min_tokens", "min_tokens must be in 0..max_tokens"),
])
def test_rest_refuses_out_of_range_with_a_400_naming_it(stack, extra, param, words):
    status, body = stack.post("/v1/completions", {"model": "tiny", "prompt": PROMPT,
                                                   "max_tokens": 4, **extra})
    assert status == 400, body
    assert body["error"]["param"] == param and body["error"]["type"] == "invalid_request_error"
    assert words in body["error"]["message"], body


@pytest.mark.parametrize("fields, words", [
    ({"repetition_penalty": -1.0}, "repetition_penalty must be > 0"),
    ({"frequency_penalty": 3.0}, "frequency_penalty must be in [-2, 2]"),
    ({"min_p": -0.5}, "min_p must be in [0, 1]"),
    ({"logit_bias": {70: 1.0}}, "logit_bias keys must be token ids in 0..63"),
    ({"logit_bias": {5: -101.0}}, "logit_bias values must be in [-100, 100]"),
    ({"min_tokens": 9}, "min_tokens must be in 0..max_tokens (4)"),
])
def test_grpc_refuses_out_of_range_as_invalid_argument(stack, fields, words):
    request = pb.generation.GenerateRequest(model="tiny", prompt="t3 t4", max_tokens=4,
                                            sampling=pb.common.SamplingParams(top_p=1.0, **fields))
    with pytest.raises(grpc.RpcError) as e:
        list(generation_stub(stack).Generate(request, metadata=auth(stack), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in e.value.details()


@pytest.mark.parametrize("fields, words", [
    ({"logit_bias": {64: 1.0}}, "logit_bias token ids outside the vocabulary"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
    ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2]"),
])
def test_the_verifier_service_checks_them_too(stack, fields, words):
    """A caller of the verifier's own gRPC API (not through the gateway) gets INVALID_ARGUMENT,
    and nothing is held for the refused request."""
    stub = rpc.verifier.VerifierStub(channel(stack.verifier_address))
    item = pb.verifier.PrefillItem(request_id="params-refused", prompt_ids=PROMPT,
                                   sampling=pb.common.SamplingParams(top_p=1.0, **fields))
    with pytest.raises(grpc.RpcError) as e:
        stub.Prefill(pb.verifier.PrefillRequest(items=[item]), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in e.value.details()
    info = stub.Info(pb.common.InfoRequest(), timeout=30)
    assert "params-refused" not in info.active_requests
