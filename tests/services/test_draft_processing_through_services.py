"""Draft processing in the drafter service (dspark.models.draft_processing behind
services/drafter): a json_schema request's drafts are masked by its grammar there, the drafter
service's blocks equal the in-process drafter's for the same requests (grammar, penalties,
min_p), a spec that cannot be compiled is INVALID_ARGUMENT, and a greedy json_schema request
gives the embedded engine's tokens through the services.

The drafter service gets no matcher and no token list per round: it compiles the item's spec
and follows the request through its context's token ids (services/drafter/request_tokens.py);
the in-process drafter reads the verifier's matcher and DraftRequest.token_ids.
"""

from __future__ import annotations

import functools
import json

import grpc
import pytest
import torch

from dspark.loading import load_method_drafter, load_target
from dspark.models.draft_types import DraftRequest
from dspark.random_draws import CounterGenerator
from dspark.sampling import SamplingParams
from dspark.serving import tensor_codec
from dspark.serving.protos import pb, rpc
from dspark.serving.remote_drafter import RemoteDrafter
from dspark.stop_tokens import stop_token_ids
from dspark.structured_output import GrammarCompiler, GrammarRequest, GrammarSpec
from loadtest.tiny_models import LAYER_IDS

from .test_structured_output_api import SCHEMA, SCHEMA_FORMAT

SPEC = GrammarSpec.json_schema(SCHEMA)
OUTPUT_SO_FAR = '{"ok":'
"""The request's output when it is drafted: a prefix of a JSON the schema allows."""


@pytest.fixture(scope="module")
def json_models(json_stack):
    """The json stack's target runner, in-process drafter, grammar compiler and stop tokens."""
    models = json_stack.models
    runner = load_target(models.target_dir, LAYER_IDS, kv_cache_tokens=2048)
    drafter = load_method_drafter(models.drafter_dir, runner, apply_calibration=True)
    compiler = GrammarCompiler(models.target_dir, runner.vocab_size)
    stops = tuple(sorted(stop_token_ids(_tokenizer(json_stack))))
    return runner, drafter, compiler, stops


@functools.lru_cache(maxsize=1)
def _read_tokenizer(folder: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def _tokenizer(json_stack):
    return _read_tokenizer(str(json_stack.models.target_dir))


def _context(json_stack, local, remote, request_id: str, seed: int) -> tuple[list[int], int]:
    """The same context (random features; a prompt, then OUTPUT_SO_FAR) for both drafters:
    (every token through the anchor, num_output)."""
    tokenizer = _tokenizer(json_stack)
    prompt = tokenizer("Give me the pick as JSON.", add_special_tokens=False)["input_ids"]
    output = tokenizer(OUTPUT_SO_FAR, add_special_tokens=False)["input_ids"]
    tokens = prompt + output
    g = torch.Generator().manual_seed(seed)
    n = len(tokens) - 1  # the anchor's position
    features = torch.randn(n, local.fc.in_features, generator=g)
    for d in (local, remote):
        d.append_context(request_id, features, torch.arange(n), torch.tensor(tokens[:-1]))
    return tokens, len(output)


def _grammar_valid_prefix(compiler, stops, output: list[int], drafts: list[int]) -> int:
    """How many of the drafts a fresh matcher after `output` accepts in a row (through a
    drafted stop token, after which nothing counts)."""
    state = compiler.start(SPEC, stops)
    state.observe(output)
    for i, token in enumerate(drafts):
        if state.terminated:
            return len(drafts)
        if not state.try_accept(token):
            return i
    return len(drafts)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_drafter_service_masks_json_drafts_as_in_process(json_stack, json_models,
                                                            temperature):
    """Every drafted token of a json_schema request is grammar-valid, and the service's blocks
    are the in-process drafter's (which reads the verifier's matcher); without the grammar the
    untrained drafter's drafts are not valid JSON, so the check can fail."""
    runner, local, compiler, stops = json_models
    remote = RemoteDrafter(json_stack.drafter_address)
    try:
        grammar = GrammarRequest(SPEC, stops)
        invalid_raw = 0
        for seed in range(6):
            rid = f"json-{temperature}-{seed}"
            tokens, num_output = _context(json_stack, local, remote, rid, seed)
            output = tokens[-num_output:]
            params = SamplingParams(temperature, seed=seed)
            state = compiler.start(SPEC, stops)
            state.observe(output)
            anchor, position = tokens[-1], len(tokens) - 1
            generator = CounterGenerator.for_seed(seed)
            expected = local.draft([DraftRequest(rid, anchor, position, params, generator,
                                                 num_output, state, grammar)])[0]
            got = remote.draft([DraftRequest(rid, anchor, position, params, generator,
                                             num_output, None, grammar)])[0]
            assert remote.fallback_rounds == 0
            assert torch.equal(got.tokens, expected.tokens), seed
            assert torch.allclose(got.dense(runner.vocab_size), expected.dense(runner.vocab_size),
                                  atol=1e-6)
            drafts = got.tokens.tolist()
            assert _grammar_valid_prefix(compiler, stops, output, drafts) == len(drafts), drafts
            raw = local.draft([DraftRequest(rid, anchor, position, params, generator,
                                            num_output)])[0].tokens.tolist()
            invalid_raw += _grammar_valid_prefix(compiler, stops, output, raw) < len(raw)
        assert invalid_raw > 0
    finally:
        remote.close()


def test_penalties_and_min_p_in_the_service_as_in_process(json_stack, json_models):
    """The penalties (read from the context's token ids in the service, from
    DraftRequest.token_ids in process) and min_p give the same blocks both ways, and a strong
    repetition penalty on the raw greedy draft's token changes it."""
    runner, local, _, _ = json_models
    remote = RemoteDrafter(json_stack.drafter_address)
    try:
        tokens, num_output = _context(json_stack, local, remote, "plain", 7)
        anchor, position = tokens[-1], len(tokens) - 1
        raw = local.draft([DraftRequest("plain", anchor, position, SamplingParams(0.0))])[0]
        # The same features, with the raw first draft in the output three times.
        tokens = tokens[:-4] + [int(raw.tokens[0])] * 3 + [anchor]
        g = torch.Generator().manual_seed(7)
        features = torch.randn(position, local.fc.in_features, generator=g)
        for case, params in enumerate((
                SamplingParams(0.0, repetition_penalty=50.0),
                SamplingParams(1.0, seed=3, repetition_penalty=1.3, frequency_penalty=0.7,
                               presence_penalty=0.4, min_p=0.05),
                SamplingParams(0.8, seed=4, top_k=12, frequency_penalty=1.5, min_p=0.2))):
            # a request per case: a request's sampling parameters (its seed among them) are fixed
            # for its life, and the service keeps its generator from the request's first round
            rid = f"pen-{case}"
            for d in (local, remote):
                d.append_context(rid, features, torch.arange(position), torch.tensor(tokens[:-1]))
            request = DraftRequest(rid, anchor, position, params, params.generator(), 5,
                                   token_ids=tokens)
            expected = local.draft([request])[0]
            got = remote.draft([request])[0]
            assert remote.fallback_rounds == 0
            assert torch.equal(got.tokens, expected.tokens), params
            assert torch.allclose(got.dense(runner.vocab_size), expected.dense(runner.vocab_size),
                                  atol=1e-6), params
            if params.is_greedy:
                assert int(got.tokens[0]) != int(raw.tokens[0])
    finally:
        remote.close()


def test_a_grammar_the_drafter_cannot_compile_is_invalid_argument(json_stack, json_models):
    channel = grpc.insecure_channel(json_stack.drafter_address)
    stub = rpc.drafter.DrafterStub(channel)
    bad = json.dumps({"kind": "json_schema", "schema": json.dumps({"type": "nope"})})
    features = torch.zeros(2, json_models[1].fc.in_features)
    update = pb.drafter.ContextUpdate(
        request_id="bad", features=tensor_codec.encode(features),
        positions=tensor_codec.encode(torch.arange(2)),
        token_ids=tensor_codec.encode(torch.tensor([5, 6])))
    item = pb.drafter.DraftItem(request_id="bad", anchor_token=7, anchor_position=2,
                                sampling=pb.common.SamplingParams(top_p=1.0), num_output=1,
                                grammar=pb.drafter.DraftGrammar(spec_json=bad,
                                                                stop_token_ids=[2]))
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Draft(iter([pb.drafter.DraftRound(round_id=1, requests=[item],
                                                    context=[update])]), timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cannot be compiled" in e.value.details(), e.value.details()
    channel.close()


def test_a_greedy_json_request_gives_the_embedded_engines_tokens(json_stack, json_models):
    from dspark.cost_table import CostTable
    from dspark.engine import AdmissionConfig, Engine, EngineConfig
    from dspark.verifier import TargetVerifier

    runner, drafter, compiler, stops = json_models
    prompt = _tokenizer(json_stack)("say it", add_special_tokens=False)["input_ids"]
    engine = Engine(TargetVerifier(runner, grammars=compiler), drafter,
                    CostTable.load(json_stack.models.cost_table),
                    EngineConfig(AdmissionConfig(policy="async_topk"), update_cost_table=False))
    rid = engine.add_request(prompt, SamplingParams(temperature=0), max_tokens=48,
                             stop_token_ids=stops, grammar=SPEC)
    request = engine.request(rid)
    while engine.has_unfinished():
        engine.step()
    expected = [t for t in request.output_ids if t not in stops]
    channel = grpc.insecure_channel(f"127.0.0.1:{json_stack.grpc_port}")
    stub = rpc.generation.GenerationStub(channel)
    request = pb.generation.GenerateRequest(
        model="tiny", prompt_token_ids=prompt, max_tokens=48,
        sampling=pb.common.SamplingParams(top_p=1.0), response_format=json.dumps(SCHEMA_FORMAT))
    got = [t for r in stub.Generate(request, timeout=60,
                                    metadata=[("authorization", f"Bearer {json_stack.api_key}")])
           for t in r.token_ids if t not in stops]
    channel.close()
    assert got == expected
    json.loads(_tokenizer(json_stack).decode(got))
