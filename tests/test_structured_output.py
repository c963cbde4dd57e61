"""Structured output (dspark.structured_output) on a tiny random target with a character-level
tokenizer that can write JSON.

Constructed: the unpacked bitmask equals xgrammar's own masking; a block's row masks are those
of a matcher advanced through the drafts one by one, and the state is unchanged after. End to
end: greedy output under a schema equals a constrained greedy loop over transformers' logits
for every policy, and parses and validates; sampled outputs follow the masked, renormalised
target distribution exactly under speculation (token, block and drafter-invariant rules).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from scipy.stats import chisquare

from dspark.cost_table import CostTable
from dspark.engine import Engine, EngineConfig
from dspark.models.runner import RunnerConfig, TargetRunner
from dspark.rejection import VerificationRule
from dspark.sampling import SamplingParams
from dspark.structured_output import (GrammarCompiler, GrammarKind, GrammarSpec, InvalidGrammar,
                                      unpack_bitmask)
from dspark.verifier import TargetVerifier
from loadtest.tiny_models import LAYER_IDS, VOCAB

from .conftest import tiny_dspark

EOS = 2
# Finite: booleans, a small integer range, a string of at most 3 characters; compact JSON.
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "n", "tag"],
          "properties": {"ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 9},
                         "tag": {"type": "string", "maxLength": 3}}}
CHOICES = ["ab", "ba", "a", "b", "bb"]
PROMPTS = [[3, 9, 27, 17], [5, 6], [11, 12, 13, 14], [40]]
DRAFT_BLOCK = 8  # so that fixed:7 verifies 7 drafts


@pytest.fixture(scope="module")
def json_target(tmp_path_factory, save_tiny_llama, save_json_tokenizer):
    """(folder, model, tokenizer) of the peaked tiny Llama with the JSON character tokenizer."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("json_target")
    model = save_tiny_llama(folder, eos_token_id=EOS)
    save_json_tokenizer(folder)
    return folder, model, AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def compiler(json_target):
    return GrammarCompiler(json_target[0], VOCAB)


def make_engine(folder, policy: str, rule=VerificationRule.TOKEN, max_running: int = 8,
                sparse_top_k: int | None = None, kv_cache_tokens: int = 8192,
                prefill_chunk_tokens: int = 256) -> Engine:
    runner = TargetRunner(folder, RunnerConfig(hidden_layer_ids=LAYER_IDS,
                                               kv_cache_tokens=kv_cache_tokens))
    drafter = tiny_dspark(0, runner, block_size=DRAFT_BLOCK) if policy != "none" else None
    # flat enough that verified drafts pay at 64 requests (async_topk admits what pays)
    table = CostTable.from_step_seconds({b: 0.01 + 0.0001 * b for b in (1, 2, 4, 8, 16, 32, 64)})
    verifier = TargetVerifier(runner, rule, GrammarCompiler(folder, VOCAB))
    return Engine(verifier, drafter, table, EngineConfig().with_values(
        policy=policy, max_running=max_running, sparse_top_k=sparse_top_k,
        prefill_chunk_tokens=prefill_chunk_tokens, update_cost_table=False))


# -- constructed ---------------------------------------------------------------------------------
def test_unpacked_bitmask_is_xgrammars_mask():
    import xgrammar

    torch.manual_seed(0)
    words = torch.randint(-2**31, 2**31 - 1, (3, 2), dtype=torch.int32)  # [3, 2]: 64 tokens
    logits = torch.zeros(3, 60)
    xgrammar.apply_token_bitmask_inplace(logits, words)
    assert torch.equal(unpack_bitmask(words, 60), logits == 0)


def test_row_masks_are_the_matchers_after_each_draft(compiler, json_target):
    tokenizer = json_target[2]
    spec = GrammarSpec.json_schema(SCHEMA)
    state = compiler.start(spec, [EOS])
    state.observe(tokenizer('{"ok": tr')["input_ids"])
    before = state.row_masks([])
    drafts = tokenizer('ue, "n": 7x')["input_ids"]  # "x" is refused where a comma must come
    masks = state.row_masks(drafts)
    assert masks.shape == (len(drafts) + 1, VOCAB)
    refused = len(drafts) - 1
    for j in range(refused + 1):
        fresh = compiler.start(spec, [EOS])
        fresh.observe(tokenizer('{"ok": tr')["input_ids"] + drafts[:j])
        assert torch.equal(masks[j], fresh.row_masks([])[0]), j
    assert not masks[refused, drafts[refused]]
    assert masks[refused + 1:].all()  # never used: left unmasked
    assert torch.equal(state.row_masks([]), before)  # rolled back


def test_the_drafters_cursor_follows_the_row_masks(compiler, json_target):
    """allowed_tokens / try_accept / rollback (what the drafter masks its drafts with) give
    row_masks' rows along the drafts, refuse the draft the grammar refuses, and roll back."""
    tokenizer = json_target[2]
    state = compiler.start(GrammarSpec.json_schema(SCHEMA), [EOS])
    state.observe(tokenizer('{"ok": tr')["input_ids"])
    drafts = tokenizer('ue, "n": 7x')["input_ids"]  # "x" is refused where a comma must come
    masks = state.row_masks(drafts)
    for j, token in enumerate(drafts[:-1]):
        assert torch.equal(state.allowed_tokens(), masks[j]), j
        assert state.try_accept(token)
    assert torch.equal(state.allowed_tokens(), masks[len(drafts) - 1])
    assert not state.try_accept(drafts[-1])
    state.rollback(len(drafts) - 1)
    assert torch.equal(state.allowed_tokens(), masks[0])
    assert torch.equal(state.row_masks(drafts), masks)


def test_stop_and_special_tokens(compiler, json_target):
    tokenizer = json_target[2]
    state = compiler.start(GrammarSpec.json_schema({"type": "string"}), [EOS])
    state.observe(tokenizer('"a')["input_ids"])
    inside = state.row_masks([])[0]
    assert not inside[EOS] and not inside[1] and not inside[0]  # control tokens are no text
    assert inside[tokenizer("b")["input_ids"][0]]
    state.observe(tokenizer('"')["input_ids"])
    assert state.row_masks([])[0].nonzero().squeeze(1).tolist() == [EOS]  # complete: only EOS
    state.observe([EOS])
    assert state.terminated


@pytest.mark.parametrize("response_format, message", [
    ({"type": "xml"}, "response_format.type"),
    ({"type": "json_schema"}, "json_schema must be an object"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema is required"),
    ({"type": "json_schema", "json_schema": {"schema": "{"}}, "not JSON"),
    ({"type": "json_schema", "json_schema": {"schema": [1]}}, "must be a JSON object"),
])
def test_bad_response_formats_are_named(response_format, message):
    with pytest.raises(InvalidGrammar, match=message):
        GrammarSpec.from_response_format(response_format)


def test_response_formats_parse(compiler):
    assert GrammarSpec.from_response_format({"type": "text"}) is None
    assert GrammarSpec.from_response_format({"type": "json_object"}).kind is GrammarKind.JSON_OBJECT
    spec = GrammarSpec.from_response_format(
        {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA, "strict": True}})
    assert GrammarSpec.from_json(spec.to_json()) == spec
    assert compiler.compile(spec) is compiler.compile(GrammarSpec.json_schema(json.dumps(SCHEMA)))
    with pytest.raises(InvalidGrammar, match="cannot be compiled"):
        compiler.compile(GrammarSpec.json_schema({"type": "no-such-type"}))


# -- end to end ----------------------------------------------------------------------------------
def constrained_greedy(model, compiler, prompt: list[int], spec: GrammarSpec,
                       max_tokens: int, bias: dict[int, float] | None = None) -> list[int]:
    """Reference: argmax of transformers' logits (plus `bias`) under the grammar, one token at
    a time."""
    state, out = compiler.start(spec, [EOS]), []
    with torch.no_grad():
        while len(out) < max_tokens and (not out or out[-1] != EOS):
            logits = model(torch.tensor([prompt + out])).logits[0, -1]
            for token, value in (bias or {}).items():
                logits[token] += value
            logits = logits.masked_fill(~state.row_masks([])[0], float("-inf"))
            out.append(int(logits.argmax()))
            state.observe(out[-1:])
    return out


def check_schema(value: dict) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(value, SCHEMA)


def run(engine: Engine) -> tuple[dict, dict, int, int]:
    """Step to the end: (tokens by request, finish reason by request, drafts admitted,
    drafts accepted)."""
    outputs, finish, admitted, accepted = {}, {}, 0, 0
    for result in engine.steps():
        admitted += result.stats.drafts_admitted
        accepted += result.stats.drafts_accepted
        for out in result.outputs:
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finish[out.request_id] = out.finish_reason
    return outputs, finish, admitted, accepted


@pytest.mark.parametrize("policy", ["none", "async_topk", "fixed:7"])
def test_greedy_schema_outputs_are_the_constrained_reference(json_target, compiler, policy):
    folder, model, tokenizer = json_target
    spec = GrammarSpec.json_schema(SCHEMA)
    engine = make_engine(folder, policy)
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, SamplingParams(temperature=0), 64, [EOS], request_id=i,
                           grammar=spec)
    outputs, finish, admitted, accepted = run(engine)
    for i, prompt in enumerate(PROMPTS):
        assert outputs[i] == constrained_greedy(model, compiler, prompt, spec, 64), i
        assert finish[i] == "stop" and outputs[i][-1] == EOS
        check_schema(json.loads(tokenizer.decode(outputs[i][:-1])))
    if policy == "fixed:7":
        assert admitted > accepted > 0  # drafts were verified, some refused by the grammar


def test_drafts_follow_the_grammar(json_target, compiler):
    """The embedded engine hands the drafter each constrained request's grammar state
    (dspark.models.draft_processing): every drafted token up to a drafted stop token continues
    the grammar, the state is back at the committed output after each call, and the outputs
    are still the constrained reference."""
    folder, model, _ = json_target
    spec = GrammarSpec.json_schema(SCHEMA)
    engine = make_engine(folder, "fixed:7")
    draft, followed = engine.drafter.draft, []

    def checked_draft(requests, **kwargs):
        blocks = draft(requests, **kwargs)
        for request, block in zip(requests, blocks):
            assert request.grammar is not None
            advanced = 0
            for token in block.tokens.tolist():
                if request.grammar.terminated:
                    break
                assert request.grammar.try_accept(token)
                advanced += 1
            request.grammar.rollback(advanced)
            followed.append(advanced)
        return blocks

    engine.drafter.draft = checked_draft
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, SamplingParams(temperature=0), 64, [EOS], request_id=i,
                           grammar=spec)
    outputs, _, admitted, accepted = run(engine)
    assert followed and admitted > 0
    for i, prompt in enumerate(PROMPTS):
        assert outputs[i] == constrained_greedy(model, compiler, prompt, spec, 64), i


def test_logit_bias_moves_only_what_the_grammar_allows(json_target, compiler):
    """logit_bias (dspark.logits_processing) and the grammar mask on the same rows: a +100 bias
    on a letter the grammar refuses outside strings changes nothing there, and one on an
    allowed letter wins where it may stand."""
    folder, model, tokenizer = json_target
    spec = GrammarSpec.json_schema(SCHEMA)
    bias = {tokenizer("z")["input_ids"][0]: 100.0, tokenizer("n")["input_ids"][0]: 100.0}
    engine = make_engine(folder, "fixed:7")
    for i, p in enumerate(PROMPTS[:2]):
        engine.add_request(p, SamplingParams(temperature=0, logit_bias=bias), 64, [EOS],
                           request_id=i, grammar=spec)
    outputs, finish, _, _ = run(engine)
    for i, prompt in enumerate(PROMPTS[:2]):
        assert outputs[i] == constrained_greedy(model, compiler, prompt, spec, 64, bias), i
        value = json.loads(tokenizer.decode(outputs[i][:-1]))
        check_schema(value)
        assert value["tag"] == "zzz"  # the string takes the biased letter up to maxLength


@pytest.mark.parametrize("chunk", [256, 0])
def test_preempted_requests_rebuild_their_grammar_state(json_target, compiler, chunk):
    """A 64-token KV cache holds one request but not four: rounds that do not fit preempt the
    newest, whose verifier state (KV cache and grammar) is released; it is rebuilt from the
    output when the request runs again, and every output is still the reference."""
    folder, model, _ = json_target
    spec = GrammarSpec.json_schema(SCHEMA)
    engine = make_engine(folder, "fixed:7", kv_cache_tokens=64, prefill_chunk_tokens=chunk)
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, SamplingParams(temperature=0), 48, [EOS], request_id=i,
                           grammar=spec)
    outputs, finish, _, _ = run(engine)
    assert engine.stats.preemptions > 0
    for i, prompt in enumerate(PROMPTS):
        assert outputs[i] == constrained_greedy(model, compiler, prompt, spec, 48), i
    assert not engine.verifier.grammar_states  # released with the requests


def exact_choice_probs(model, compiler, prompt: list[int], spec: GrammarSpec,
                       tokenizer) -> torch.Tensor:
    """P(each of CHOICES, then EOS) under the target at temperature 1 with the grammar's mask
    applied and renormalised at every step, by enumeration: [len(CHOICES)] float64."""
    probs = []
    with torch.no_grad():
        for choice in CHOICES:
            tokens = tokenizer(json.dumps(choice))["input_ids"] + [EOS]
            state, logp = compiler.start(spec, [EOS]), 0.0
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:]
            for j, token in enumerate(tokens):
                row = logits[j].double().masked_fill(~state.row_masks([])[0], float("-inf"))
                logp += float(torch.log_softmax(row, 0)[token])
                state.observe([token])
            probs.append(math.exp(logp))
    return torch.tensor(probs, dtype=torch.float64)


@pytest.mark.parametrize("policy, rule", [
    ("fixed:7", VerificationRule.TOKEN), ("fixed:7", VerificationRule.BLOCK),
    ("async_topk", VerificationRule.DRAFTER_INVARIANT)])
def test_sampled_choices_follow_the_masked_target(json_target, compiler, policy, rule):
    folder, model, tokenizer = json_target
    spec = GrammarSpec.json_schema({"enum": CHOICES})
    prompt = [3, 9, 27]
    expected = exact_choice_probs(model, compiler, prompt, spec, tokenizer)
    assert abs(float(expected.sum()) - 1.0) < 1e-6  # the grammar admits nothing else
    num = 1000
    engine = make_engine(folder, policy, rule, max_running=64, sparse_top_k=8)
    for i in range(num):
        engine.add_request(prompt, SamplingParams(temperature=1.0), 8, [EOS], request_id=i,
                           grammar=spec)
    outputs, _, admitted, _ = run(engine)
    texts = [json.loads(tokenizer.decode(o[:-1])) for o in outputs.values()]
    assert all(o[-1] == EOS for o in outputs.values())
    observed = torch.tensor([texts.count(c) for c in CHOICES], dtype=torch.float64)
    exp = expected * num
    big = exp >= 5
    obs = torch.cat([observed[big], observed[~big].sum(0, keepdim=True)])
    exp = torch.cat([exp[big], exp[~big].sum(0, keepdim=True)])
    assert float(chisquare(obs.numpy(), (exp / exp.sum() * obs.sum()).numpy()).pvalue) > 1e-3
    assert admitted > 0
