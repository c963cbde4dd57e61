"""The request's processing applied to its drafts (dspark.models.draft_processing): logit_bias,
min_tokens' stop-token ban, the repetition / frequency / presence penalties, min_p and a
grammar mask change the draft logits before sampling, and the reported draft distribution is
exactly the processed one.

References: transformers' MinNewTokensLengthLogitsProcessor, SequenceBiasLogitsProcessor,
RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, MinPLogitsWarper and TopKLogitsWarper
on the drafter's teacher-forced logits at each block position (frequency and presence, which
transformers lacks, by OpenAI's formula token by token), and a brute-force grammar (a rule on
the previous token) for the mask.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (LogitsProcessorList, MinNewTokensLengthLogitsProcessor,
                          MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                          SequenceBiasLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper)

from dspark.models.draft_types import DraftRequest
from dspark.models.eagle import EagleDrafter
from dspark.random_draws import CounterGenerator
from dspark.sampling import SamplingParams

from .test_drafter import GAMMA, VOCAB, _chi2_pvalue, make_drafter, sequence, teacher_forced

PROMPT_LENGTH = 5
"""Tokens before the output in the transformers reference's input (any: it skips them)."""


def reference_processed(logits: torch.Tensor, params: SamplingParams, num_output: int,
                        k: int, draft_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Block position k's (1-based) logits [V_d] processed by transformers: the output before
    x_k holds num_output + k - 1 tokens. draft_ids [V_d]: the target id of each draft id."""
    V_d = logits.shape[0]
    target_ids = torch.arange(V_d) if draft_ids is None else draft_ids
    full = torch.full((VOCAB,), -1e4)  # over the target vocabulary
    full[target_ids] = logits.float()
    processors = LogitsProcessorList()
    if params.min_tokens and params.stop_token_ids:
        processors.append(MinNewTokensLengthLogitsProcessor(
            PROMPT_LENGTH, params.min_tokens, list(params.stop_token_ids)))
    if params.logit_bias:
        processors.append(SequenceBiasLogitsProcessor({(t,): b for t, b in params.logit_bias}))
    ids = torch.zeros(1, PROMPT_LENGTH + num_output + k - 1, dtype=torch.int64)
    return processors(ids, full.unsqueeze(0))[0][target_ids]


def drafter_and_anchor(draft_ids: torch.Tensor | None = None):
    model = make_drafter("markov", bias_std=3.0, draft_ids=draft_ids)
    ids, feats = sequence()
    model.append_context("r", feats[0, :9], torch.arange(9))
    return model, ids, feats


def test_greedy_drafts_are_the_argmax_of_the_processed_logits():
    model, ids, feats = drafter_and_anchor()
    anchor = int(ids[0, 9])
    plain = model.draft([DraftRequest("r", anchor, 9, SamplingParams(0.0))])[0].tokens
    # Ban the unprocessed first draft, favour another token, and hold the unprocessed second
    # draft back as a stop token for the first two positions (num_output 4, min_tokens 6).
    params = SamplingParams(0.0, logit_bias={int(plain[0]): -100.0, 7: 2.0}, min_tokens=6,
                            stop_token_ids=(int(plain[1]),))
    block = model.draft([DraftRequest("r", anchor, 9, params, num_output=4)])[0]
    logits, _ = teacher_forced(model, ids, feats, 9, block.tokens)  # [gamma, V]
    expected = torch.stack([reference_processed(logits[k], params, 4, k + 1)
                            for k in range(GAMMA)]).argmax(-1)
    assert torch.equal(block.tokens, expected)
    assert int(block.tokens[0]) != int(plain[0])
    assert int(plain[1]) not in block.tokens[:2].tolist()


@pytest.mark.parametrize("reduced", [False, True])
def test_sampled_drafts_report_the_processed_distribution(reduced):
    """At T = 1 every position's reported q is the processed softmax of the teacher-forced
    logits (prefix: the drafts drawn), and the first drafts follow it (chi-square). With a
    reduced draft vocabulary, a bias on a token outside it changes nothing."""
    draft_ids = torch.arange(0, VOCAB, 2) if reduced else None  # even target ids
    model, ids, feats = drafter_and_anchor(draft_ids)
    anchor = int(ids[0, 9])
    params = SamplingParams(1.0, logit_bias={4: 3.0, 6: -100.0, 9: 5.0}, min_tokens=3,
                            stop_token_ids=(2, 8))
    num = 2000
    requests = [DraftRequest(i, anchor, 9, params, CounterGenerator.for_seed(i), num_output=1)
                for i in range(num)]
    for r in requests:
        model.append_context(r.request_id, feats[0, :9], torch.arange(9))
    blocks = model.draft(requests)
    target_ids = torch.arange(VOCAB) if draft_ids is None else draft_ids
    for block in blocks[:20]:  # the reported q, position by position
        logits, _ = teacher_forced(model, ids, feats, 9, block.tokens)
        for k in range(GAMMA):
            q = torch.softmax(reference_processed(logits[k], params, 1, k + 1, draft_ids), -1)
            reported = block.dense(VOCAB)[k][target_ids]
            assert torch.allclose(reported, q, atol=1e-5), k
    first = torch.tensor([int(b.tokens[0]) for b in blocks])
    assert not set(first.tolist()) & {2, 6, 8}  # min_tokens (output 1 < 3) and the -100 bias
    logits, _ = teacher_forced(model, ids, feats, 9, blocks[0].tokens)
    q1 = torch.zeros(VOCAB)
    q1[target_ids] = torch.softmax(reference_processed(logits[0], params, 1, 1, draft_ids), -1)
    assert _chi2_pvalue(torch.bincount(first, minlength=VOCAB), q1) > 1e-3


class ParityGrammar:
    """A brute-force grammar over target ids: after token p, only tokens of the other parity
    (p + t odd) are allowed, and token 0 ends the output. The GrammarState interface the
    drafter reads (allowed_tokens, try_accept, rollback, terminated)."""

    def __init__(self, last: int) -> None:
        self.history = [last]
        self.accepted = 0

    @property
    def terminated(self) -> bool:
        return self.history[-1] == 0 and len(self.history) > 1

    def allowed_tokens(self) -> torch.Tensor:
        t = torch.arange(VOCAB)
        return ((t + self.history[-1]) % 2 == 1) | (t == 0)

    def try_accept(self, token: int) -> bool:
        if self.terminated or not bool(self.allowed_tokens()[token]):
            return False
        self.history.append(token)
        self.accepted += 1
        return True

    def rollback(self, n: int) -> None:
        del self.history[len(self.history) - n:]
        self.accepted -= n


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_grammar_masks_every_position_and_rolls_back(temperature):
    model, ids, feats = drafter_and_anchor()
    anchor = int(ids[0, 9])
    for seed in range(20):
        grammar = ParityGrammar(anchor)
        params = SamplingParams(temperature, seed=seed)
        block = model.draft([DraftRequest("r", anchor, 9, params, num_output=1,
                                          grammar=grammar)])[0]
        assert grammar.history == [anchor] and grammar.accepted == 0  # rolled back
        logits, _ = teacher_forced(model, ids, feats, 9, block.tokens)
        follower = ParityGrammar(anchor)
        for k, token in enumerate(block.tokens.tolist()):
            if follower.terminated:
                break  # nothing after a drafted stop token is used
            allowed = follower.allowed_tokens()
            q = torch.softmax(logits[k].masked_fill(~allowed, float("-inf")), -1)
            if temperature == 0:
                assert token == int(q.argmax())
            else:
                assert torch.allclose(block.dense(VOCAB)[k], q, atol=1e-5)
            assert follower.try_accept(token)


def test_a_grammar_outside_a_reduced_vocabulary_leaves_the_row_unprocessed():
    """Odd target ids only in the draft vocabulary, a grammar allowing only even ones: no draft
    id is allowed, so the row keeps its unprocessed logits (a distribution, not NaN)."""
    draft_ids = torch.arange(1, VOCAB, 2)
    model, ids, feats = drafter_and_anchor(draft_ids)

    class EvenOnly(ParityGrammar):
        def allowed_tokens(self) -> torch.Tensor:
            return torch.arange(VOCAB) % 2 == 0

    anchor = int(ids[0, 9])
    plain = model.draft([DraftRequest("r", anchor, 9, SamplingParams(0.0))])[0]
    masked = model.draft([DraftRequest("r", anchor, 9, SamplingParams(0.0),
                                       grammar=EvenOnly(anchor))])[0]
    assert torch.equal(plain.tokens, masked.tokens)


def test_the_eagle_drafter_processes_its_drafts_too():
    from .test_eagle import make_eagle
    from .test_eagle import sequence as eagle_sequence

    model = make_eagle()
    assert isinstance(model, EagleDrafter)
    ids, feats = eagle_sequence()
    model.append_context("r", feats[0, :9], torch.arange(9), ids[0, :9])
    anchor = int(ids[0, 9])
    plain = model.draft([DraftRequest("r", anchor, 9, SamplingParams(0.0))])[0].tokens
    params = SamplingParams(0.0, logit_bias={int(plain[0]): -100.0})
    biased = model.draft([DraftRequest("r", anchor, 9, params)])[0].tokens
    assert int(biased[0]) != int(plain[0])


def reference_penalised(logits: torch.Tensor, params: SamplingParams, prompt: list[int],
                        output: list[int], draft_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The distribution of a draft after `prompt` and `output` (the request's output, then the
    block's earlier drafts), from its logits [V_d], by transformers' processors and warpers:
    the penalties, then temperature, min_p and top-k; [V_d] probabilities (greedy: one-hot)."""
    target_ids = torch.arange(logits.shape[0]) if draft_ids is None else draft_ids
    full = torch.full((VOCAB,), -1e4)  # over the target vocabulary
    full[target_ids] = logits.float()
    ids = torch.tensor([prompt + output])
    processors = LogitsProcessorList()
    if params.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    scores = processors(ids, full.unsqueeze(0))[0]
    for token in set(output):  # OpenAI's frequency and presence penalties
        scores[token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
    scores = scores[target_ids]
    if params.is_greedy:
        return torch.nn.functional.one_hot(scores.argmax(), scores.shape[0]).float()
    warpers = LogitsProcessorList([TemperatureLogitsWarper(params.temperature)])
    if params.min_p:
        warpers.append(MinPLogitsWarper(params.min_p))
    if params.top_k:
        warpers.append(TopKLogitsWarper(params.top_k))
    return torch.softmax(warpers(ids, scores.unsqueeze(0))[0], -1)


PENALTIES = dict(repetition_penalty=1.6, frequency_penalty=0.9, presence_penalty=0.6)


def test_greedy_drafts_take_the_penalised_argmax_counting_earlier_drafts():
    """The raw greedy block's tokens are put in the output, so the penalties bite; every
    position is the argmax after the penalties over the prompt, the output and the block's
    earlier drafts (which the reference counts as output)."""
    model, ids, feats = drafter_and_anchor()
    anchor = int(ids[0, 9])
    plain = model.draft([DraftRequest("r", anchor, 9, SamplingParams(0.0))])[0].tokens
    tokens = ids[0, :10].tolist()
    tokens[6:9] = plain[:3].tolist()  # output: positions 6..9, the anchor last
    for penalties in (PENALTIES, dict(repetition_penalty=3.0), dict(frequency_penalty=2.0),
                      dict(presence_penalty=2.0)):
        params = SamplingParams(0.0, **penalties)
        block = model.draft([DraftRequest("r", anchor, 9, params, num_output=4,
                                          token_ids=tokens)])[0]
        logits, _ = teacher_forced(model, ids, feats, 9, block.tokens)  # [gamma, V]
        drafts = block.tokens.tolist()
        for k in range(GAMMA):
            q = reference_penalised(logits[k], params, tokens[:6], tokens[6:] + drafts[:k])
            assert drafts[k] == int(q.argmax()), (penalties, k)
        if penalties is PENALTIES:
            assert not torch.equal(block.tokens, plain)


@pytest.mark.parametrize("reduced, top_k", [(False, 0), (True, 0), (False, 6)])
def test_sampled_drafts_report_the_penalised_min_p_distribution(reduced, top_k):
    """At T = 0.8 with penalties and min_p (top_k 6: the sparse rows, where min_p works on the
    top-k logits) every position's reported q is the reference distribution after the
    prompt, the output and the drafts drawn before it; the first drafts follow it
    (chi-square)."""
    draft_ids = torch.arange(0, VOCAB, 2) if reduced else None  # even target ids
    model, ids, feats = drafter_and_anchor(draft_ids)
    anchor = int(ids[0, 9])
    tokens = ids[0, :10].tolist()
    tokens[5:9] = [4, 6, 4, 10]  # output: positions 5..9
    params = SamplingParams(0.8, top_k=top_k, min_p=0.05, **PENALTIES)
    num = 2000
    requests = [DraftRequest(i, anchor, 9, params, CounterGenerator.for_seed(i), num_output=5,
                             token_ids=tokens) for i in range(num)]
    for r in requests:
        model.append_context(r.request_id, feats[0, :9], torch.arange(9))
    blocks = model.draft(requests)
    target_ids = torch.arange(VOCAB) if draft_ids is None else draft_ids
    for block in blocks[:20]:
        logits, _ = teacher_forced(model, ids, feats, 9, block.tokens)
        drafts = block.tokens.tolist()
        for k in range(GAMMA):
            q = reference_penalised(logits[k], params, tokens[:5], tokens[5:] + drafts[:k],
                                    draft_ids)
            reported = block.dense(VOCAB)[k][target_ids]
            assert torch.allclose(reported, q, atol=1e-5), k
    logits, _ = teacher_forced(model, ids, feats, 9, blocks[0].tokens)
    q1 = torch.zeros(VOCAB)
    q1[target_ids] = reference_penalised(logits[0], params, tokens[:5], tokens[5:], draft_ids)
    assert bool((q1[target_ids] == 0).any())  # min_p cuts some of the draft vocabulary
    first = torch.tensor([int(b.tokens[0]) for b in blocks])
    assert _chi2_pvalue(torch.bincount(first, minlength=VOCAB), q1) > 1e-3


def test_a_penalised_draft_request_without_its_tokens_is_refused():
    model, ids, _ = drafter_and_anchor()
    with pytest.raises(ValueError, match="token_ids"):
        model.draft([DraftRequest("r", int(ids[0, 9]), 9,
                                  SamplingParams(0.0, presence_penalty=1.0))])
