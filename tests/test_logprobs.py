"""The target's log-probabilities of produced tokens (dspark.logprobs) through the embedded engine,
against an independent reference: transformers' forward over prompt + output, log_softmax at
each output position. Under speculation (accepted drafts, recovered and bonus tokens), with
prefill fused, chunked or separate, greedy and sampled, beside requests that did not ask."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dspark.cost_table import CostTable
from dspark.engine import AdmissionConfig, Engine, EngineConfig
from dspark.loading import load_method_drafter, load_target
from dspark.logprobs import TokenLogprobs, grouped_token_logprobs, token_logprobs
from dspark.sampling import SamplingParams
from loadtest.tiny_models import GAMMA, LAYER_IDS, build_tiny_models
from dspark.verifier import TargetVerifier

PROMPTS = [[3, 9, 27, 17], [5, 6], [11, 12, 13, 14, 15, 16, 2], [40], [8, 8, 8, 8, 8]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(tiny models, their target as a transformers model): the services' tiny stack."""
    from transformers import LlamaForCausalLM

    models = build_tiny_models(tmp_path_factory.mktemp("logprobs"))
    return models, LlamaForCausalLM.from_pretrained(models.target_dir).eval()


def make_engine(models, policy: str, **config) -> Engine:
    runner = load_target(models.target_dir, LAYER_IDS, kv_cache_tokens=4096)
    drafter = load_method_drafter(models.drafter_dir, runner, apply_calibration=True)
    return Engine(TargetVerifier(runner), drafter, CostTable.load(models.cost_table),
                  EngineConfig().with_values(policy=policy, update_cost_table=False, **config))


def reference_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), vocab] log_softmax of transformers' logits at each output position."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0].float()  # [len(prompt) + len(output), vocab]
    return torch.log_softmax(logits[len(prompt) - 1:len(prompt) - 1 + len(output)], dim=-1)


def assert_matches_reference(model, prompt, output, got: TokenLogprobs, num_top: int) -> None:
    ref = reference_logprobs(model, prompt, output)
    assert len(got) == len(output)
    expected = ref.gather(1, torch.tensor(output).unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(got.token_logprobs, expected, atol=1e-4, rtol=1e-4)
    assert got.top_token_ids.shape == (len(output), num_top)
    top_values, _ = torch.topk(ref, num_top, dim=-1)
    torch.testing.assert_close(got.top_logprobs, top_values, atol=1e-4, rtol=1e-4)
    # the reported alternatives are the tokens with those log-probabilities
    torch.testing.assert_close(ref.gather(1, got.top_token_ids), got.top_logprobs, atol=1e-4,
                               rtol=1e-4)


def run_collecting(engine, requests, stop_token_ids=()) -> list:
    """requests: [(prompt, sampling, max_tokens, logprobs)] -> [(engine request, output,
    TokenLogprobs | None)], the log-probabilities as streamed, checked against the tokens."""
    rids = [engine.add_request(p, s, n, stop_token_ids, logprobs=k) for p, s, n, k in requests]
    added = engine.waiting[-len(rids):]
    asked = {rid: k for rid, (_, _, _, k) in zip(rids, requests)}
    tokens = {rid: [] for rid in rids}
    pieces = {rid: [] for rid in rids}
    for out in engine.stream():
        tokens[out.request_id] += out.new_token_ids
        assert (out.logprobs is None) == (asked[out.request_id] is None)
        if out.logprobs is not None:
            assert len(out.logprobs) == len(out.new_token_ids)
            pieces[out.request_id].append(out.logprobs)
    return [(request, tokens[rid], TokenLogprobs.cat(pieces[rid]) if pieces[rid] else None)
            for request, rid in zip(added, rids)]


@pytest.mark.parametrize("policy", ["none", f"fixed:{GAMMA}", "async_topk"])
@pytest.mark.parametrize("chunk", [256, 3, 0])  # prefill_chunk_tokens: fused, chunked, separate
def test_logprobs_are_the_targets_log_softmax(tiny, policy, chunk):
    models, model = tiny
    engine = make_engine(models, policy, prefill_chunk_tokens=chunk)
    greedy, sampled = SamplingParams(temperature=0), SamplingParams(temperature=0.7, seed=5)
    requests = [(PROMPTS[0], greedy, 12, 5), (PROMPTS[1], sampled, 12, 0),
                (PROMPTS[2], greedy, 12, None), (PROMPTS[3], sampled, 12, 20)]
    done = run_collecting(engine, requests)
    for (prompt, _, max_tokens, num_top), (_, output, got) in zip(requests, done):
        assert len(output) == max_tokens
        if num_top is None:
            assert got is None
            continue
        assert_matches_reference(model, prompt, output, got, num_top)


def test_speculation_emits_several_tokens_a_round_with_their_logprobs(tiny):
    """Rounds that accept drafts emit accepted drafts and a bonus token together: each gets its
    own row (the draft's position, not the round's last)."""
    models, model = tiny
    engine = make_engine(models, f"fixed:{GAMMA}")
    rid = engine.add_request(PROMPTS[4], SamplingParams(temperature=0), 24, logprobs=3)
    request = engine.waiting[0]
    outputs = [o for o in engine.stream() if o.request_id == rid]
    assert request.metrics.drafts_accepted > 0 and max(len(o.new_token_ids) for o in outputs) > 1
    got = TokenLogprobs.cat([o.logprobs for o in outputs])
    assert_matches_reference(model, PROMPTS[4], request.output_ids, got, 3)


def test_a_stop_token_cuts_the_logprobs_with_the_tokens(tiny):
    models, model = tiny
    engine = make_engine(models, f"fixed:{GAMMA}")
    first = engine.generate([PROMPTS[0]], SamplingParams(temperature=0), max_tokens=24)[0]
    stop = first.output_ids[5]
    [(_, output, got)] = run_collecting(engine, [(PROMPTS[0], SamplingParams(temperature=0), 24, 2)],
                                     stop_token_ids=[stop])
    assert output == first.output_ids[:first.output_ids.index(stop) + 1]
    assert len(got) == len(output)
    assert_matches_reference(model, PROMPTS[0], output, got, 2)


def test_grouped_rows_equal_one_request_at_a_time():
    torch.manual_seed(0)
    logits = torch.randn(5, 64) * 3  # [5 rows, vocab]
    tokens = torch.randint(0, 64, (5,))
    groups = grouped_token_logprobs(logits, tokens, [(2, 1), (3, 4)])
    alone = [token_logprobs(logits[:2], tokens[:2], 1), token_logprobs(logits[2:], tokens[2:], 4)]
    for g, a in zip(groups, alone):
        assert torch.equal(g.top_token_ids, a.top_token_ids)
        torch.testing.assert_close(g.token_logprobs, a.token_logprobs)
        torch.testing.assert_close(g.top_logprobs, a.top_logprobs)


def test_a_top_count_outside_0_to_20_is_refused(tiny):
    engine = make_engine(tiny[0], "none")
    for bad in (-1, 21):
        with pytest.raises(ValueError, match="0..20"):
            engine.add_request([3], logprobs=bad)


@pytest.mark.slow
def test_real_target_logprobs_under_speculation(smollm2_dir):
    """SmolLM2-135M (fp32) with the shipped drafter verifying 7 drafts a round: the reported
    log-probabilities equal transformers' log_softmax, greedy and sampled."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dspark.models.drafter_config import DrafterConfig

    drafter_dir = Path(__file__).resolve().parents[1] / "checkpoints" / "dspark-markov"
    layer_ids = tuple(DrafterConfig.load(drafter_dir).target_layer_ids)
    runner = load_target(smollm2_dir, layer_ids, kv_cache_tokens=2048, dtype="float32")
    drafter = load_method_drafter(drafter_dir, runner, apply_calibration=True)
    engine = Engine(TargetVerifier(runner), drafter,
                    CostTable.from_step_seconds({1: 0.06, 8: 0.09, 16: 0.12, 64: 0.33}),
                    EngineConfig(AdmissionConfig(policy="fixed:7"), update_cost_table=False))
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompt = list(tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three primary colours."}], add_generation_prompt=True,
        tokenize=True, return_dict=True)["input_ids"])
    requests = [(prompt, SamplingParams(temperature=0), 24, 5),
                (prompt, SamplingParams(temperature=0.8, seed=11), 24, 2)]
    done = run_collecting(engine, requests)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    for (_, _, _, num_top), (request, output, got) in zip(requests, done):
        assert request.metrics.drafts_accepted > 0 and len(output) > 5
        ref = reference_logprobs(model, prompt, output)
        expected = ref.gather(1, torch.tensor(output).unsqueeze(1)).squeeze(1)
        torch.testing.assert_close(got.token_logprobs, expected, atol=2e-3, rtol=1e-3)
        torch.testing.assert_close(got.top_logprobs, torch.topk(ref, num_top).values,
                                   atol=2e-3, rtol=1e-3)
